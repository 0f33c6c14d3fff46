"""verl.single_controller: workers, ``@register`` and worker groups over ``scaletrain.controller``."""

"""verl's module paths over scaletrain's objects: ``scaletrain.compat.verl.X`` stands for ``verl.X``.

A verl user's extension code (a custom estimator or policy loss, a reward manager, a worker, code that reads and
writes ``DataProto``) ports by changing ``from verl...`` to ``from scaletrain.compat.verl...``. Each module here
re-exports scaletrain's implementation under verl's name; where verl's argument list differs from scaletrain's
spelling, a thin adapter takes verl's. There is one implementation per behaviour: registering an estimator here
registers it with scaletrain's trainer. docs/porting.md lists what is covered; ``make test-verl`` measures it
with verl's own CPU tests.
"""

from scaletrain.compat.verl.protocol import DataProto

__all__ = ["DataProto"]

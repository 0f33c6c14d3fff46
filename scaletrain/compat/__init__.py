"""Compatibility layers for code written against other frameworks (beside the layers, importing from them).

``compat/verl/`` mirrors verl's module paths (``scaletrain.compat.verl.protocol``,
``...trainer.ppo.core_algos``, ``...single_controller.ray``) over scaletrain's own objects, so a verl user's
estimator, policy loss, reward manager or worker ports by changing its import lines.
"""

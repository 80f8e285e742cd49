"""Importing this module installs the verl integration (:func:`chunked_entropy.integrations.verl.install`).

Name it where verl loads third-party code in every worker, without editing verl::

    VERL_USE_EXTERNAL_MODULES=chunked_entropy.integrations.verl_plugin python -m verl.trainer.main_ppo ...
    # or
    python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=chunked_entropy.integrations.verl_plugin

The patch is applied once per process and says so in the log.
"""

from .verl import install

install()

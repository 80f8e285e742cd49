"""The settings of a policy objective, under verl 0.9.1's config field names and with verl's defaults.

Layer: loss utilities, their base. :class:`PolicyOptions` holds every field any
objective of :mod:`chunked_entropy.losses.registry` reads; an objective
ignores the fields it does not read, as verl's config does. Values are
checked on construction (naming the field), and
:meth:`PolicyOptions.from_actor_config` reads them from a verl actor config.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields, replace
from typing import Optional, Union

from .._checks import ByValue, check_real, is_finite_real, plain_str, value_repr
from ..config import config_entry, config_section

#: Rollout-correction IS levels and loss types of verl's ``RolloutCorrectionConfig``.
ROLLOUT_IS_LEVELS = (None, "token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")


def _positive(name: str, value, *, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    if not (is_finite_real(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0{' or None' if optional else ''}, got "
                         f"{value_repr(value)}")
    return float(value)


@dataclass(frozen=True, eq=False)
class PolicyOptions(ByValue):
    """An objective's settings: verl 0.9.1's ``ActorConfig`` / ``PolicyLossConfig`` / ``RolloutCorrectionConfig``
    fields, with verl's defaults.

    Attributes:
        clip_ratio: the PPO clip range (DPPO: the divergence threshold), used
            where ``clip_ratio_low`` / ``clip_ratio_high`` are None.
        clip_ratio_low, clip_ratio_high: the clip range's two sides.
        clip_ratio_c: the dual-clip bound of ``vanilla`` (> 1; None: no dual
            clip) and the truncation of DPPO's ratio.
        tau_pos, tau_neg: SAPO's gate temperatures for positive and other advantages (> 0).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's share of tokens and covariance window.
        kl_cov_ratio, ppo_kl_coef: KL-Cov's share of tokens and penalty.
        dro_beta: DRO's quadratic log-ratio penalty (required by ``dro``).
        loss_type: ``bypass_mode``'s loss, ``"ppo_clip"`` or ``"reinforce"``.
        rollout_is: ``bypass_mode``'s IS level, ``"sequence"``, ``"token"`` or None.
        rollout_is_threshold: its truncation (a float) or IcePop window (``"lower_upper"``).
        rollout_is_batch_normalize: normalize its IS weights to mean 1.
        rollout_rs: its rejection criteria (comma separated, e.g. ``"token_k1,seq_max_k2"``), or None.
        rollout_rs_threshold: their thresholds.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None
    loss_type: str = "ppo_clip"
    rollout_is: Optional[str] = "sequence"
    rollout_is_threshold: Union[float, str] = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Union[None, float, str] = None

    def _key(self) -> tuple:  # every field, as fingerprint() covers them
        return tuple(getattr(self, f.name) for f in fields(self))

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for f in fields(self):  # numpy.str_ and the like: plain names
            set_(f.name, plain_str(getattr(self, f.name)))
        set_("clip_ratio", check_real("clip_ratio", self.clip_ratio, low=0.0))
        for k in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, k)
            set_(k, None if v is None else check_real(k, v, low=0.0))
        if self.low > 1:
            raise ValueError(f"clip_ratio_low must be in [0, 1] (the ratio's lower bound is 1 - clip_ratio_low), "
                             f"got {self.low!r}")
        c = self.clip_ratio_c
        if c is not None and not (is_finite_real(c) and c > 1):
            raise ValueError(f"clip_ratio_c must be a finite number > 1 (the dual-clip bound) or None, got "
                             f"{value_repr(c)}")
        set_("clip_ratio_c", None if c is None else float(c))
        for k in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio"):
            set_(k, _positive(k, getattr(self, k)))
        for k in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            set_(k, check_real(k, getattr(self, k)))
        set_("dro_beta", _positive("dro_beta", self.dro_beta, optional=True))
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_LEVELS}, got {self.rollout_is!r}")
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise TypeError(f"rollout_is_batch_normalize must be a bool, got {self.rollout_is_batch_normalize!r}")
        if self.rollout_rs is not None and not isinstance(self.rollout_rs, str):
            raise TypeError(f"rollout_rs must be a string of comma-separated criteria or None, got {self.rollout_rs!r}")

    @property
    def low(self) -> float:
        """The clip range's lower side: ``clip_ratio_low``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """The clip range's upper side: ``clip_ratio_high``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def replace(self, **changes) -> "PolicyOptions":
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def fingerprint(self) -> int:
        """What the ranks of a tensor-parallel group must agree on."""
        return zlib.crc32(repr([getattr(self, f.name) for f in fields(self)]).encode()) & 0x7FFFFFFF

    @classmethod
    def from_actor_config(cls, config) -> "PolicyOptions":
        """The options of a verl actor config (``actor_rollout_ref.actor``: an ``ActorConfig``, an
        OmegaConf node or a dict): its clip fields, SAPO's taus, ``policy_loss``'s fields and
        ``policy_loss.rollout_correction``'s. Fields it lacks keep verl's defaults. A config (or a section of it)
        that is not a mapping is a ``TypeError``, an OmegaConf ``???`` a ``ValueError``, each naming the key."""
        top = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
        pl = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
        rc = ("loss_type", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
              "rollout_rs_threshold")
        config = config_section(config, "config", optional=False)
        policy = config_section(config_entry(config, "policy_loss", "policy_loss"), "policy_loss")
        corr = config_section(config_entry(policy, "rollout_correction", "policy_loss.rollout_correction"),
                              "policy_loss.rollout_correction")
        # a field the config holds is taken as it is (None too: it means "off" for rollout_is, rollout_rs)
        found = {}
        for keys, node, where in ((top, config, ""), (pl, policy, "policy_loss."),
                                  (rc, corr, "policy_loss.rollout_correction.")):
            for k in keys:
                value = config_entry(node, k, where + k, _ABSENT)
                if value is not _ABSENT:
                    found[k] = value
        return cls(**found)


_ABSENT = object()


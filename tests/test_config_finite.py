"""Every float setting of every config section is finite: `trainer.lr: .inf` passes `gt=0`, and
`model.tiny.init_std: .inf` builds an infinite model; both trained NaN (issue 36). relayrl.config refuses
inf and NaN for every float field (allow_inf_nan=False), a field opting out only where infinity means something."""

from __future__ import annotations

import math
import types
import typing

import pytest
from pydantic import ValidationError

import relayrl.jobs.sft_config  # noqa: F401 - its sections are Config subclasses too
from relayrl.config import Config, apply_overrides
from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError

pytestmark = pytest.mark.unit


def _types(annotation) -> list:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict, tuple, typing.Annotated):
        return [t for a in typing.get_args(annotation) for t in _types(a)]
    return [annotation]


def _subclasses(cls: type) -> set[type]:
    return {cls} | {s for sub in cls.__subclasses__() for s in _subclasses(sub)}


def _float_fields() -> list[tuple[type[Config], str]]:
    """Every float field of every config section relayrl defines (the run's, sft's, the sections they hold)."""
    sections = [c for c in _subclasses(Config) if c.__module__.startswith("relayrl.")]
    return sorted(((cls, name) for cls in sections for name, f in cls.model_fields.items()
                   if float in _types(f.annotation)), key=lambda cn: (cn[0].__module__, cn[0].__name__, cn[1]))


FLOAT_FIELDS = _float_fields()


def test_the_walk_finds_the_float_settings():
    names = {f"{cls.__name__}.{name}" for cls, name in FLOAT_FIELDS}
    assert {"TrainerConfig.lr", "TinyModelConfig.init_std", "RewardConfig.timeout_s", "AlgoConfig.clip_low"} <= names
    assert len(FLOAT_FIELDS) > 40


@pytest.mark.parametrize("cls, name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
def test_every_float_field_refuses_inf_and_nan(cls, name):
    section = cls.model_construct()
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValidationError) as e:
            setattr(section, name, bad)
        assert [err["type"] for err in e.value.errors()] == ["finite_number"], (name, bad, e.value.errors())


@pytest.mark.parametrize("override, key, got", [("trainer.lr=.inf", "trainer.lr", "inf"),
                                                ("model.tiny.init_std=.inf", "model.tiny.init_std", "inf"),
                                                ("trainer.grad_clip=.nan", "trainer.grad_clip", "nan"),
                                                ("algo.kl_coef=-.inf", "algo.kl_coef", "-inf")])
def test_an_infinite_override_is_one_line_naming_the_key(override, key, got):
    data = apply_overrides({"model": {"tiny": {}}, "data": {"task": "arith"}}, [override])
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(data)
    assert str(e.value) == f"config error: {key}: Input should be a finite number (got {got})"


def test_finite_values_still_pass():
    cfg = RunConfig.from_dict(apply_overrides({"model": {"tiny": {}}, "data": {"task": "arith"}},
                                              ["trainer.lr=3e-3", "model.tiny.init_std=0.02", "trainer.grad_clip=1e9"]))
    assert (cfg.trainer.lr, cfg.model.tiny.init_std, cfg.trainer.grad_clip) == (3e-3, 0.02, 1e9)

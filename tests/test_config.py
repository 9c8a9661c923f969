import dataclasses

import pytest

from fthsdp import config as config_lib
from fthsdp.config import Config, ConfigError


def test_base_and_variants_load_and_compose():
    base = config_lib.load("configs/base.py")
    wide = config_lib.load("wide")
    assert base.name == "base" and wide.name == "wide"
    assert wide.model.d_model > base.model.d_model
    assert wide.optim == base.optim  # untouched sections come from the base
    ft = config_lib.load("ft_local")
    assert ft.launch.replicas == 3 and ft.launch.kill == ("1@40",)


def test_overrides_are_typed():
    cfg = config_lib.load("base", ["optim.lr=0.5", "model.num_layers=3", "ft.intervention=linear",
                                   "launch.kill=0@5,2@9", "train.out_dir=/tmp/x"])
    assert cfg.optim.lr == 0.5 and isinstance(cfg.optim.lr, float)
    assert cfg.model.num_layers == 3
    assert cfg.launch.kill == ("0@5", "2@9")


@pytest.mark.parametrize("bad,msg", [
    ("optim.lrr=1", "no field 'lrr' in OptimConfig"),
    ("optim.lr=fast", "expected float"),
    ("optim", "section.field=value"),
    ("optim.lr.x=1", "not a config section"),
    ("model.num_heads=3", "not divisible"),
    ("ft.intervention=cubic", "unknown LR intervention"),
    ("data.seq_len=1000", "exceeds model.max_seq_len"),
])
def test_bad_overrides_say_what_is_wrong(bad, msg):
    with pytest.raises(ValueError, match=msg):
        config_lib.load("base", [bad])


def test_unknown_config_lists_the_available_ones(tmp_path):
    with pytest.raises(ConfigError, match="available: .*base"):
        config_lib.load("nope")
    f = tmp_path / "bad.py"
    f.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="must define a module-level `config"):
        config_lib.load(str(f))


def test_user_config_file_outside_the_repo(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("import dataclasses\nfrom configs.base import config as base\n"
                 "config = dataclasses.replace(base, name='mine', train=dataclasses.replace(base.train, steps=7))\n")
    cfg = config_lib.load(str(f))
    assert cfg.name == "mine" and cfg.train.steps == 7
    assert dataclasses.asdict(cfg)["model"] == dataclasses.asdict(Config().model)

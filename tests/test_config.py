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
    ("optim=adamw", "'optim' is a section, not a value: set its fields one by one"),  # (not OptimConfig('adamw'))
    ("train.steps=" + "9" * 400, "train.steps="),  # past a float's range: refused, not an OverflowError
    ("data.eval_batches=0", "gives it no batch"),
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


# --- every field checked before anything starts (issue 13, item 4) -----------------------------

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from fthsdp import config_checks  # noqa: E402
from fthsdp.timeouts import Timeouts  # noqa: E402


def test_every_field_of_every_section_has_a_rule():
    """A field added without a rule would be accepted with any value: name it here."""
    names = {name for name, _, _ in config_checks.leaf_fields(Config())}
    missing = sorted(names - set(config_checks.RULES))
    assert not missing, f"add a rule for {missing} to fthsdp.config_checks.RULES"
    stale = sorted(set(config_checks.RULES) - names)
    assert not stale, f"rules for fields that no longer exist: {stale}"
    # Timeouts have one owner: exactly Timeouts' fields are delegated to it.
    delegated = {n for n, r in config_checks.RULES.items() if isinstance(r, config_checks.Timeout)}
    assert delegated == {f"ft.{f.name}" for f in dataclasses.fields(Timeouts)}


@pytest.mark.parametrize("name", ["base", "wide", "ft_local", "lr_study", "lr_study_quick"])
def test_shipped_configs_validate(name):
    assert config_lib.load(name).name == name


@pytest.mark.parametrize("bad,msg", [
    ("optim.lr=nan", "optim.lr=nan: must be a finite number > 0"),
    ("optim.lr=inf", "optim.lr=inf: must be a finite number > 0"),
    ("optim.lr=0", "optim.lr=0.0: must be a finite number > 0"),
    ("optim.b2=1", r"optim.b2=1.0: must be a finite number >= 0 and < 1"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1: must be a finite number >= 0"),
    ("ft.detect_s=-1", r"ft.detect_s=-1.0: must be a finite number of seconds > 0"),
    ("ft.detect_s=nan", r"ft.detect_s=nan: must be a finite number"),
    ("ft.allreduce_timeout_s=0", r"ft.allreduce_timeout_s=0.0: must be a finite number of seconds > 0"),
    ("ft.quorum_timeout_s=1e300", r"ft.quorum_timeout_s=1e\+300: must be .* <= 604800"),
    ("ft.allreduce_timeout_s=0.5", r"ft.detect_s=0.8 must be < ft.allreduce_timeout_s=0.5"),
    ("ft.catch_up_timeout_s=115", r"ft.allreduce_timeout_s \+ ft.catch_up_timeout_s = 125 must be < "
                                  r"ft.quorum_timeout_s=120: .* catch-up's all-reduce"),
    ("ft.max_retries=-1", r"ft.max_retries=-1: must be an integer >= 0"),
    ("ft.streams_per_peer=65", r"ft.streams_per_peer=65: must be an integer >= 1 and <= 64"),
    ("ft.checkpoint_every=0", r"ft.checkpoint_every=0: must be an integer >= 1"),
    ("ft.peer_serve_cap_gbps=-1", r"ft.peer_serve_cap_gbps=-1.0: must be a finite number >= 0"),
    ("ft.min_replicas=4", r"ft.min_replicas=4 must be <= launch.replicas=3"),
    ("data.seq_len=0", r"data.seq_len=0: must be an integer >= 1"),
    ("data.batch_size=0", r"data.batch_size=0: must be an integer >= 1"),
    ("data.corpus_bytes=10", r"data.corpus_bytes=10: must be an integer >= 1024"),
    ("data.seed=-1", r"data.seed=-1: must be an integer >= 0 and <= 4294967295"),
    ("train.steps=-5", r"train.steps=-5: must be an integer >= 0"),
    ("train.log_every=0", r"train.log_every=0: must be an integer >= 1"),
    ("train.out_dir=", r"train.out_dir='': is empty"),
    ("train.min_step_s=-1", r"train.min_step_s=-1.0: must be a finite number >= 0"),
    ("model.dtype=banana", r"model.dtype='banana': must be one of float32, bfloat16, float16"),
    ("model.vocab_size=100", r"model.vocab_size=100: must be an integer >= 256"),
    ("model.num_layers=0", r"model.num_layers=0: must be an integer >= 1"),
    ("optim.decay=linear", r"optim.decay='linear': must be one of cosine, constant"),
    ("ft.intervention=cubic", r"ft.intervention='cubic': unknown LR intervention 'cubic'; choose one of: none"),
    ("ft.snapshot=always", r"ft.snapshot='always': must be one of on_demand, every_commit"),
    ("train.pace=sometimes", r"train.pace='sometimes': must be one of always, degraded"),
    ("ft.test_hold_view=5", r"ft.test_hold_view='5': expected STEP:SECONDS or STEP:SECONDS:recovering with STEP >= 0 "
                            r"and 0 < SECONDS <= 600"),
    ("ft.test_hold_view=5:2:healthy", r"ft.test_hold_view='5:2:healthy': expected STEP:SECONDS or "),
    ("ft.test_die_before_ledger=9", r"ft.test_die_before_ledger='9': bad --test_die_before_ledger '9': expected "
                                    r"REPLICA@STEP"),
    ("ft.test_hold_view=2:0", r"ft.test_hold_view='2:0': expected STEP:SECONDS"),
    ("launch.kill=garbage", r"launch.kill=\('garbage',\): bad --kill 'garbage': expected REPLICA@STEP"),
    ("launch.stop=1@x", r"launch.stop=\('1@x',\): bad --stop '1@x': expected REPLICA@STEP"),
    ("launch.kill=-1@5", r"launch.kill=\('-1@5',\): .*must be >= 0"),
    ("launch.lighthouse=127.0.0.1:99999", r"launch.lighthouse='127.0.0.1:99999': not host:port with a port in "
                                          r"1..65535"),
    ("ft.lighthouse_relays=127.0.0.1:0", r"ft.lighthouse_relays=\('127.0.0.1:0',\): not host:port with a port in "
                                         r"1..65535"),
    ("launch.relays=5", r"launch.relays=5 must be <= launch.replicas=3: each relay carries a block"),
    ("launch.relays=-1", r"launch.relays=-1: must be an integer >= 0"),
    ("launch.relay_placement=rack", r"launch.relay_placement='rack': must be one of lighthouse, replicas"),
    ("launch.replicas=0", r"launch.replicas=0: must be an integer >= 1"),
    ("launch.restart_delay_s=nan", r"launch.restart_delay_s=nan: must be a finite number >= 0"),
    ("launch.random_kills=-2", r"launch.random_kills=-2: must be an integer >= 0"),
    ("data.seq_len=100", r"data.seq_len=100 exceeds model.max_seq_len=64"),
])
def test_out_of_range_values_are_refused_naming_the_field_and_what_is_allowed(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        config_lib.load("ft_local", [bad])


@pytest.mark.parametrize("overrides, msg", [
    (["launch.lighthouse_connection_calls_per_s=0"], r"launch.lighthouse_connection_calls_per_s=0.0: must be"),
    (["launch.lighthouse_connection_calls_per_s=15"],
     r"=15 leaves no room: a replica process's heartbeats alone send 10 calls/s .* give at least 20"),
    (["launch.lighthouse_connection_calls_per_s=500", "launch.lighthouse=127.0.0.1:29510"],
     r"is for the launcher's own lighthouse, but the job uses the external lighthouse .* --connection-calls-per-s"),
    (["launch.lighthouse_beats_per_s=-1"], r"launch.lighthouse_beats_per_s=-1.0: must be"),
    (["launch.lighthouse_beats_per_s=800", "launch.lighthouse=127.0.0.1:29510"],
     r"lighthouse_beats_per_s=800 is for the launcher's own lighthouse, .* give that lighthouse --beats-per-s"),
])
def test_lighthouse_connection_budget_is_checked(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        config_lib.load("base", overrides)


def test_an_external_lighthouses_heartbeat_budget_is_its_own():
    """With launch.lighthouse set, the budget is that lighthouse's --connection-calls-per-s: fast
    heartbeats are not refused against the launcher's default it cannot change."""
    cfg = config_lib.load("base", ["launch.lighthouse=127.0.0.1:29510", "ft.heartbeat_interval_s=0.01"])
    assert cfg.ft.heartbeat_interval_s == 0.01
    with pytest.raises(ConfigError, match="give at least 200"):
        config_lib.load("base", ["ft.heartbeat_interval_s=0.01"])


def test_override_values_are_stripped():
    assert config_lib.load("base", ["train.out_dir= runs/x "]).train.out_dir == "runs/x"


def test_lighthouse_connection_budget_defaults_to_the_lighthouses_own():
    from fthsdp.control.admission import FairnessLimits

    assert config_lib.load("base").launch.lighthouse_connection_calls_per_s == FairnessLimits().connection_calls_per_s
    assert config_lib.load("base", ["launch.lighthouse_connection_calls_per_s=2500"]
                           ).launch.lighthouse_connection_calls_per_s == 2500.0


def test_launcher_relays_need_sessions_and_exclude_named_relays():
    with pytest.raises(ConfigError, match=r"launch.relays=1 needs ft.lighthouse_session=true"):
        config_lib.load("base", ["launch.relays=1", "ft.lighthouse_session=false"])
    with pytest.raises(ConfigError, match=r"launch.relays=1 starts the launcher's own relays, but "
                                          r"ft.lighthouse_relays names"):
        config_lib.load("base", ["launch.relays=1", "ft.lighthouse_relays=127.0.0.1:7001"])


def test_relays_split_the_replicas_in_contiguous_blocks():
    from fthsdp.control.relay import relay_of

    cfg = config_lib.load("base", ["ft.lighthouse_relays=127.0.0.1:7001,127.0.0.2:7001"])
    assert cfg.ft.lighthouse_relays == ("127.0.0.1:7001", "127.0.0.2:7001")
    relays = cfg.ft.lighthouse_relays
    assert [relay_of(relays, i, 5) for i in range(5)] == [relays[0]] * 3 + [relays[1]] * 2
    assert relay_of(relays, 7, 5) == relays[0]  # a launcher's own numbering wraps around
    assert relay_of((), 3, 5) == ""


def test_a_relay_placed_with_its_replicas_goes_to_its_blocks_first_replica():
    from fthsdp.control.relay import block_first, relay_index

    assert [block_first(i, 2, 5) for i in range(2)] == [0, 3]  # blocks 0-2 and 3-4
    assert [block_first(i, 3, 3) for i in range(3)] == [0, 1, 2]
    assert [block_first(i, 3, 8) for i in range(3)] == [0, 3, 6]
    for replicas in range(1, 30):  # the first of each block is the lowest replica it carries
        for relays in range(1, replicas + 1):
            firsts = [block_first(i, relays, replicas) for i in range(relays)]
            assert firsts == [min(r for r in range(replicas) if relay_index(relays, r, replicas) == i)
                              for i in range(relays)]
    with pytest.raises(ValueError, match="relay 2 of 2 for 5 replica"):
        block_first(2, 2, 5)
    with pytest.raises(ValueError, match="relays=0"):
        relay_index(0, 1, 5)
    cfg = config_lib.load("base", ["launch.replicas=4", "launch.relays=2", "launch.relay_placement=replicas"])
    assert cfg.launch.relay_placement == "replicas"


def test_launch_lighthouse_accepts_host_port_or_empty():
    assert config_lib.load("base", ["launch.lighthouse=127.0.0.1:29510"]).launch.lighthouse == "127.0.0.1:29510"
    assert config_lib.load("base", ["launch.lighthouse=localhost:1"]).launch.lighthouse == "localhost:1"
    assert config_lib.load("base").launch.lighthouse == ""


@pytest.mark.parametrize("section,field,value,msg", [
    ("model", "d_model", "128", r"model.d_model='128': must be an integer >= 1"),
    ("model", "d_model", True, r"model.d_model=True: must be an integer >= 1"),
    ("optim", "lr", float("nan"), r"optim.lr=nan: must be a finite number > 0"),
    ("optim", "lr", None, r"optim.lr=None: must be a finite number > 0"),
    ("launch", "kill", ["1@5"], r"launch.kill=\['1@5'\]: must be a tuple of strings"),
    ("launch", "restart", "yes", r"launch.restart='yes': must be true or false"),
    ("ft", "heartbeat_interval_s", "0.1", r"ft.heartbeat_interval_s='0.1': must be a finite number"),
])
def test_wrong_types_from_a_config_file_are_refused(section, field, value, msg):
    """Config files are Python: a value of the wrong type is refused at load, not deep in a job."""
    cfg = Config()
    bad = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
    with pytest.raises(ConfigError, match=msg):
        bad.validate()


def test_a_config_file_that_raises_is_reported_as_failing_to_load(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("from configs.base import config\nraise RuntimeError('oops in the config')\n")
    with pytest.raises(ConfigError, match=r"config .*broken.py failed to load: RuntimeError: oops in the config"):
        config_lib.load(str(f))
    assert "_fthsdp_config_broken" not in sys.modules  # a half-run module is not left behind
    f.write_text("config = (\n")
    with pytest.raises(ConfigError, match=r"config .*broken.py failed to load: SyntaxError"):
        config_lib.load(str(f))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fthsdp.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["train", "run"])
def test_every_cli_that_loads_a_config_prints_the_error_without_a_traceback(tmp_path, command):
    raising = tmp_path / "raising.py"
    raising.write_text("x = 1 / 0\n")
    cases = [
        (["model.dtype=banana"], "model.dtype='banana': must be one of float32, bfloat16, float16"),
        (["ft.detect_s=-1"], "ft.detect_s=-1.0: must be a finite number of seconds > 0"),
        (["--config", str(raising)], f"config {raising} failed to load: ZeroDivisionError: division by zero"),
    ]
    for args, msg in cases:
        r = _cli(command, *args)
        assert r.returncode == 2, r.stderr
        assert msg in r.stderr
        assert "Traceback" not in r.stderr


def _with(cfg, name, value):
    section, _, field_name = name.rpartition(".")
    if not section:
        return dataclasses.replace(cfg, **{field_name: value})
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field_name: value})})


def _numeric_fields():
    return [(name, typ) for name, _, typ in config_checks.leaf_fields(Config()) if typ in (int, float)]


@pytest.mark.parametrize("name,typ", _numeric_fields())
def test_every_numeric_field_refuses_non_finite_and_out_of_range_values(name, typ):
    """Finiteness and range, field by field: a value outside each rule is refused naming the field."""
    cfg = config_lib.load("ft_local")
    bad_values = [float("nan"), float("inf"), -float("inf")] if typ is float else [1.5, True]
    rule = config_checks.RULES[name]
    if isinstance(rule, config_checks.Number) and rule.lo is not None:
        bad_values.append(type(getattr_path(cfg, name))(rule.lo) - 1)
    if isinstance(rule, config_checks.Number) and rule.hi is not None:
        bad_values.append(type(getattr_path(cfg, name))(rule.hi) + 1)
    if isinstance(rule, config_checks.Timeout):
        bad_values += [0.0, -1.0, Timeouts.MAX_S * 2]
    for value in bad_values:
        with pytest.raises(ConfigError, match=rf"^{re.escape(name)}=.*must be"):
            _with(cfg, name, value).validate()


def getattr_path(cfg, name):
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg



def test_pacing_applies_always_or_only_while_a_replica_is_out():
    from fthsdp.replica.manager import step_pace_s

    assert step_pace_s(0.5, "always", 3, 3) == 0.5 and step_pace_s(0.5, "always", 2, 3) == 0.5
    assert step_pace_s(0.5, "degraded", 2, 3) == 0.5  # a replica is out: paced
    assert step_pace_s(0.5, "degraded", 3, 3) == 0.0  # everyone is back: the model's own speed
    assert step_pace_s(0.0, "degraded", 1, 3) == 0.0

"""The configuration system: loading config files, overrides, validation, and the CLI's error contract.

CLI contract: `python train.py CONFIG.py[:ARG] [a.b=value | --config.a.b=value | --config.a.b value ...]`;
any user mistake gives exactly one line on stderr starting with "error: " (naming the key or file and
the fix), exit status 2, and no traceback.
"""
import json
import os
import subprocess

import ml_collections
import pytest

from MaxOffload.config import ConfigError, defaults, load
from MaxOffload.config.validate import validate
from MaxOffload.parallel.consensus import flat_items


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
LLAMA = os.path.join(ROOT, "configs", "llama3_1.py")


def assert_user_error(result, *words):
    """exit 2, exactly one stderr line starting with 'error: ' that contains every word, no traceback."""
    err = result.stderr
    assert result.returncode == 2, f"exit {result.returncode}; stderr:\n{err}\nstdout tail:\n{result.stdout[-2000:]}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


# --------------------------------------------------------------------------------------------
# In-process loading
# --------------------------------------------------------------------------------------------

def test_quickstart_values():
    cfg = load([QUICKSTART])
    assert cfg.run.output_dir == "runs/quickstart"
    assert cfg.train.steps == 300
    assert cfg.train.per_device_batch_size == 8
    assert cfg.train.seq_len == 256
    assert cfg.train.learning_rate == pytest.approx(3e-3)
    assert cfg.train.warmup_steps == 20
    assert cfg.train.eval_every == 100
    assert cfg.run.log_every == 10
    # the "small" preset
    assert (cfg.model.vocab_size, cfg.model.emb_dim, cfg.model.num_layers, cfg.model.num_heads,
            cfg.model.num_kv_heads, cfg.model.head_dim, cfg.model.mlp_dim) == (512, 256, 4, 8, 4, 32, 704)
    # untouched defaults
    assert cfg.data.source == "text"
    assert list(cfg.data.text_files) == []
    assert cfg.remat.policy == "full"
    assert cfg.model.family == "llama"


@pytest.mark.parametrize("spec, seq_len, ways", [("llama3_1_offload.py:405b_128k", 131072, 8),
                                                  ("deepseek_v3_offload.py:671b_32k", 32768, 8)])
def test_long_context_variants_split_each_sequence_over_the_context_axis(spec, seq_len, ways):
    """A recipe's _32k / _128k variant: one sequence per `ways` GPUs, the weights (not the activations' batch)
    sharded over the context axis too, 16.8M tokens a step, load-balanced, the rest of the recipe unchanged (for
    DeepSeek-V3 the FSDP x EP8 layout's: its EP64 one holds no context axis)."""
    base_spec = {"deepseek_v3_offload.py:671b_32k": "deepseek_v3_offload.py:671b_fsdp"}.get(spec, spec.rsplit("_", 1)[0])
    cfg, base = load([os.path.join(ROOT, "configs", spec)]), load([os.path.join(ROOT, "configs", base_spec)])
    assert (cfg.train.seq_len, cfg.mesh.ici.context, cfg.train.per_device_batch_size) == (seq_len, ways, 1 / ways)
    assert cfg.train.global_batch_size * seq_len == 2 ** 24
    assert "context" in cfg.mesh.rules.embed and "context" not in cfg.mesh.rules.activation_batch
    assert cfg.mesh.context_load_balance and not base.mesh.context_load_balance
    assert cfg.remat.to_dict() == base.remat.to_dict() and cfg.run.output_dir == base.run.output_dir + "_" + \
        spec.rsplit("_", 1)[1]


def test_llama3_1_405b_values():
    cfg = load([f"{LLAMA}:405b"])
    m = cfg.model
    assert (m.vocab_size, m.emb_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (
        128256, 16384, 126, 128, 8, 128, 53248)
    assert m.rope_theta == 500000.0
    assert m.rope_scaling == "llama3"
    assert (m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_len) == (
        8.0, 1.0, 4.0, 8192)
    assert m.tie_embeddings is False
    assert cfg.train.seq_len == 8192
    assert cfg.train.per_device_batch_size == 1
    assert cfg.train.learning_rate == pytest.approx(1.5e-4)
    assert cfg.train.warmup_steps == 2000
    assert cfg.train.steps == 100_000
    assert cfg.data.source == "synthetic"
    assert cfg.run.output_dir == "runs/llama3_1_405b"


def test_llama3_1_tiny_and_default_size():
    tiny = load([f"{LLAMA}:tiny"])
    assert (tiny.model.emb_dim, tiny.model.num_layers, tiny.model.head_dim) == (64, 2, 16)
    assert tiny.data.source == "text"  # small sizes keep the real text
    default = load([LLAMA])  # no :ARG -> get_config() -> 8b
    assert (default.model.emb_dim, default.model.num_layers, default.model.mlp_dim) == (4096, 32, 14336)


def test_loaded_config_is_locked():
    cfg = load([QUICKSTART])
    with pytest.raises(AttributeError):
        cfg.train.stepz = 3


def test_config_file_receives_its_arg(tmp_path):
    path = tmp_path / "with_arg.py"
    path.write_text(
        "from MaxOffload.config.defaults import get_config as defaults\n"
        "def get_config(arg='none-given'):\n"
        "    cfg = defaults()\n"
        "    cfg.run.output_dir = 'runs/arg_' + arg\n"
        "    return cfg\n")
    assert load([f"{path}:hello"]).run.output_dir == "runs/arg_hello"
    assert load([f"{path}:8b"]).run.output_dir == "runs/arg_8b"
    assert load([str(path)]).run.output_dir == "runs/arg_none-given"
    # the --config=FILE:ARG spelling of the first argument
    assert load([f"--config={path}:xyz"]).run.output_dir == "runs/arg_xyz"


# --------------------------------------------------------------------------------------------
# Overrides and value parsing
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["train.steps=77"],
    ["--config.train.steps=77"],
    ["--config.train.steps", "77"],
], ids=["plain", "flag_eq", "flag_space"])
def test_override_styles(args):
    cfg = load([QUICKSTART, *args])
    assert cfg.train.steps == 77 and type(cfg.train.steps) is int


def test_override_styles_mixed_and_last_wins():
    cfg = load([QUICKSTART, "train.steps=70", "--config.model.num_layers", "2",
                "--config.train.seq_len=32", "train.steps=90"])
    assert (cfg.train.steps, cfg.model.num_layers, cfg.train.seq_len) == (90, 2, 32)


@pytest.mark.parametrize("override,key,expected,typ", [
    ("train.steps=120", "train.steps", 120, int),
    ("train.steps=1_000", "train.steps", 1000, int),
    ("train.learning_rate=1e-3", "train.learning_rate", 1e-3, float),
    ("train.learning_rate=2", "train.learning_rate", 2.0, float),
    ("train.final_lr_ratio=0.25", "train.final_lr_ratio", 0.25, float),
    ("model.scan_layers=false", "model.scan_layers", False, bool),
    ("model.scan_layers=true", "model.scan_layers", True, bool),
    ("model.tie_embeddings=1", "model.tie_embeddings", True, bool),
    ("model.scan_layers=0", "model.scan_layers", False, bool),
    ("model.tie_embeddings=True", "model.tie_embeddings", True, bool),
    ("model.param_dtype=bfloat16", "model.param_dtype", "bfloat16", str),
    ("run.output_dir=runs/elsewhere", "run.output_dir", "runs/elsewhere", str),
    ("remat.policy=minimal_offloaded", "remat.policy", "minimal_offloaded", str),
    ("remat.tensors.mlpwo=offload", "remat.tensors.mlpwo", "offload", str),
])
def test_value_parsing(override, key, expected, typ):
    cfg = load([QUICKSTART, override])
    node = cfg
    for part in key.split("."):
        node = node[part]
    assert node == expected
    assert type(node) is typ


@pytest.fixture
def two_text_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\n")
    b.write_text("second file\n")
    return str(a), str(b)


@pytest.mark.parametrize("form", ["{a},{b}", "['{a}','{b}']", "[{a},{b}]"], ids=["bare", "quoted_list", "list"])
def test_list_value(two_text_files, form):
    a, b = two_text_files
    cfg = load([QUICKSTART, "data.text_files=" + form.format(a=a, b=b)])
    assert list(cfg.data.text_files) == [a, b]


def test_list_value_through_flag_with_space(two_text_files):
    a, b = two_text_files
    cfg = load([QUICKSTART, "--config.data.text_files", f"{a},{b}"])
    assert list(cfg.data.text_files) == [a, b]


def test_list_value_items_are_stripped(two_text_files):
    """`a, b` (a space after the comma, e.g. quoted in a shell) should mean the same as `a,b`."""
    a, b = two_text_files
    cfg = load([QUICKSTART, f"data.text_files={a}, {b}"])
    assert list(cfg.data.text_files) == [a, b]


def test_empty_list_value():
    assert list(load([QUICKSTART, "data.text_files="]).data.text_files) == []
    assert list(load([QUICKSTART, "data.text_files=[]"]).data.text_files) == []


def test_placeholder_field_accepts_none_and_values():
    placeholders = [(key, spec) for key, spec in flat_items(defaults.SCHEMA) if len(spec) == 3]
    assert placeholders  # hardware.peak_tflops_per_device at least
    for key, (_, typ, _) in placeholders:
        cfg = load([QUICKSTART, f"{key}=none"])
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node is None
        sample = {int: "3", float: "0.5", bool: "true", str: "text"}.get(typ)
        if sample is not None:
            cfg = load([QUICKSTART, f"{key}={sample}"])
            node = cfg
            for part in key.split("."):
                node = node[part]
            assert type(node) is typ


def _number_keys():
    """Every float and int key of the schema."""
    cfg = defaults.get_config()
    for key in defaults.flat_keys(cfg):
        parent, _, leaf = key.rpartition(".")
        kind = defaults.get_path(cfg, parent).get_type(leaf)
        if kind in (float, int):
            yield key, kind


def test_every_number_key_refuses_nan_inf_and_huge_values():
    """The general check (config/validate.py _check_numbers): each float key given nan, inf or -inf and each
    integer key given 2**40 is a ConfigError naming that key, whatever its own checks."""
    base = load([f"{LLAMA}:tiny", "run.dry_run=true"])
    keys = list(_number_keys())
    assert len([k for k, kind in keys if kind is float]) >= 25 and len(keys) >= 75
    for key, kind in keys:
        for value in ((float("nan"), float("inf"), -float("inf")) if kind is float else (2**40,)):
            cfg = ml_collections.ConfigDict(base.to_dict())
            parent, _, leaf = key.rpartition(".")
            defaults.get_path(cfg, parent)[leaf] = value
            with pytest.raises(ConfigError) as e:
                validate(cfg)
            assert str(e.value).startswith(f"{key}="), (key, value, str(e.value))


def test_the_size_bounds_leave_the_largest_recipes_alone():
    for spec in (f"{LLAMA}:405b", os.path.join(ROOT, "configs", "deepseek_v3.py:671b")):
        load([spec])  # no ConfigError: 126 layers, 4e11 / 3.8e10 parameters per token are within the bounds


def test_in_process_errors_are_config_errors():
    with pytest.raises(ConfigError, match="train.steps"):
        load([QUICKSTART, "train.stpes=3"])
    with pytest.raises(ConfigError, match="no config"):
        load([])


# --------------------------------------------------------------------------------------------
# Bad inputs through the real CLI
# --------------------------------------------------------------------------------------------

TINY = "configs/llama3_1.py:tiny"


def _error_cases(tmp):
    """id -> (argv after `train.py`, words the error line must contain)."""
    out = os.path.join(tmp, "out")
    dry = [TINY, "run.dry_run=true", f"run.output_dir={out}"]
    deepseek = ["configs/deepseek_v3.py:tiny", "run.dry_run=true", f"run.output_dir={out}"]
    # a real (non-dry) run, as small as possible: data files are only read when the data is built
    real = [TINY, f"run.output_dir={out}", "train.steps=2", "train.warmup_steps=0", "train.seq_len=16",
            "train.per_device_batch_size=2", "train.eval_batches=1"]

    def write(name, text, mode="w"):
        path = os.path.join(tmp, name)
        with open(path, mode) as f:
            f.write(text)
        return path

    no_get_config = write("no_get_config.py", "X = 1\n")
    raises = write("raises.py", "def get_config():\n    raise RuntimeError('boom from the user config')\n")
    syntax = write("syntax.py", "def get_config(:\n    pass\n")
    returns_dict = write("returns_dict.py", "def get_config():\n    return {'train': {'steps': 3}}\n")
    unknown_key = write("unknown_key.py",
                        "from MaxOffload.config.defaults import get_config as defaults\n"
                        "def get_config():\n    cfg = defaults()\n    cfg.model.emb_dimm = 3\n    return cfg\n")
    yaml = write("config.yaml", "train:\n  steps: 3\n")
    not_utf8 = write("latin1.txt", ("caf\xe9 cr\xe8me br\xfbl\xe9e, d\xe9j\xe0 vu. " * 50).encode("latin-1"), mode="wb")
    short = write("short.txt", "Too short.\n")
    regular_file = write("regular_file", "not a directory\n")
    missing = os.path.join(tmp, "missing.txt")

    return {
        "unknown_key_suggests": (dry + ["train.stpes=3"], ["train.stpes", "did you mean train.steps"]),
        "unknown_nested_key_suggests": (dry + ["model.num_head=3"], ["model.num_head", "model.num_heads"]),
        "unknown_option": (dry + ["--foo"], ["--foo"]),
        "first_arg_is_an_option": (["--config.train.steps=3"], ["config file"]),
        "override_without_equals": (dry + ["trainsteps"], ["trainsteps", "KEY=VALUE"]),
        "flag_without_value": (dry + ["--config.train.steps"], ["--config.train.steps"]),
        "int_given_text": (dry + ["train.steps=abc"], ["train.steps", "abc"]),
        "int_given_float": (dry + ["train.steps=2.5"], ["train.steps", "2.5"]),
        "bool_given_maybe": (dry + ["model.scan_layers=maybe"], ["model.scan_layers", "maybe"]),
        "float_given_x": (dry + ["train.learning_rate=x"], ["train.learning_rate"]),
        # "none" is a string for string fields (model.rope_scaling=none is a real choice): a plain bad choice
        "none_for_str_field": (dry + ["model.family=none"], ["model.family", "'none' is not one of llama"]),
        "none_for_int_field": (dry + ["train.steps=none"], ["train.steps", "cannot be None"]),
        "unparsable_list": (dry + ["data.text_files=[unclosed"], ["data.text_files"]),
        "steps_zero": (dry + ["train.steps=0"], ["train.steps", "> 0"]),
        "negative_learning_rate": (dry + ["train.learning_rate=-1e-3"], ["train.learning_rate", ">= 0"]),
        "eval_fraction_above_one": (dry + ["data.eval_fraction=1.5"], ["data.eval_fraction"]),
        "final_lr_ratio_above_one": (dry + ["train.final_lr_ratio=2"], ["train.final_lr_ratio"]),
        "adam_b1_one": (dry + ["train.adam_b1=1"], ["train.adam_b1"]),
        "warmup_not_below_steps": (dry + ["train.steps=5", "train.warmup_steps=5"],
                                   ["train.warmup_steps", "train.steps"]),
        "kv_heads_not_dividing": (dry + ["model.num_kv_heads=3"], ["model.num_kv_heads", "model.num_heads"]),
        "odd_head_dim": (dry + ["model.head_dim=15"], ["model.head_dim", "even"]),
        "unknown_dtype": (dry + ["model.compute_dtype=float16"], ["model.compute_dtype", "float16", "bfloat16"]),
        "unknown_remat_policy": (dry + ["remat.policy=minimall"], ["remat.policy", "did you mean minimal"]),
        "bad_remat_tensor_value": (dry + ["remat.tensors.mlpwo=offlod"], ["remat.tensors.mlpwo", "offload"]),
        "untagged_remat_tensor": (dry + ["remat.tensors.moe_mlpwi_0=offload"], ["moe_mlpwi_0", "llama"]),
        "unknown_model_family": (dry + ["model.family=gpt"], ["model.family", "gpt", "llama"]),
        "vocab_below_tokenizer": (dry + ["model.vocab_size=258"], ["model.vocab_size", "259"]),
        "missing_text_file": (dry + [f"data.text_files={missing}"], ["data.text_files", "missing.txt"]),
        "non_utf8_text_file": (real + [f"data.text_files={not_utf8}"], ["latin1.txt", "UTF-8"]),
        "text_too_short_for_seq_len": (real + [f"data.text_files={short}", "train.seq_len=64"], ["train.seq_len"]),
        "output_dir_under_regular_file": ([TINY, "run.dry_run=true",
                                           f"run.output_dir={os.path.join(regular_file, 'sub')}"],
                                          ["run.output_dir"]),
        "missing_config_file": (["configs/does_not_exist.py"], ["configs/does_not_exist.py", "not found"]),
        "config_not_python": ([yaml], ["config.yaml", "Python"]),
        "config_without_get_config": ([no_get_config], ["no_get_config.py", "get_config"]),
        "config_get_config_raises": ([raises], ["raises.py", "boom from the user config"]),
        "config_syntax_error": ([syntax], ["syntax.py", "SyntaxError"]),
        "config_returns_dict": ([returns_dict], ["returns_dict.py", "ConfigDict"]),
        "config_unknown_size_arg": (["configs/llama3_1.py:huge", "run.dry_run=true"], ["huge", "405b"]),
        "config_sets_unknown_key": ([unknown_key], ["unknown_key.py", "emb_dimm"]),
        "aot_topology_zeros": (dry + ["aot.topology=0x0x0"], ["aot.topology='0x0x0'", "at least 1"]),
        # nan / inf and huge integers: one line before any JAX work (they trained "fine" or ended in tracebacks)
        "norm_eps_inf": (dry + ["model.norm_eps=inf"], ["model.norm_eps=inf", "finite"]),
        "learning_rate_nan": (dry + ["train.learning_rate=nan"], ["train.learning_rate=nan", "finite"]),
        "capacity_factor_inf": (deepseek + ["model.capacity_factor=inf"], ["model.capacity_factor=inf", "finite"]),
        "moe_buffer_factor_inf": (deepseek + ["model.moe_buffer_factor=inf"],
                                  ["model.moe_buffer_factor=inf", "finite"]),
        "capacity_factor_past_every_token": (deepseek + ["model.capacity_factor=1e9"],
                                             ["model.capacity_factor", "num_experts / num_experts_per_tok = 4"]),
        "num_layers_huge": (dry + ["model.num_layers=1000000000000"], ["model.num_layers", "2,147,483,647"]),
        "num_layers_too_many": (dry + ["model.num_layers=100000"], ["100,000 layers", "model.num_layers"]),
        "head_dim_huge": (dry + ["model.head_dim=2147483646"], ["parameters per token", "model.emb_dim"]),
        "seed_huge": (dry + ["run.seed=10000000000000000000000"], ["run.seed", "extra digit"]),
        # the planner reads the scanned layer segments: unrolled layers planned nothing (measured on the v5e)
        "auto_with_unrolled_layers": (dry + ["remat.policy=auto", "model.scan_layers=false"],
                                      ["remat.policy=auto", "model.scan_layers=false"]),
        "all_to_all_with_a_capacity": (dry + ["mesh.exchange=all_to_all", "model.capacity_factor=1.0"],
                                       ["mesh.exchange=all_to_all is dropless", "model.capacity_factor=0"]),
    }


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    """Runs every bad input once, all in one `train.py` process (tests/helpers/train_many.py: each case's own
    stdout/stderr at the file descriptors, its exit status), not one Python + JAX start-up per case."""
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("bad_inputs")
    cases = _error_cases(str(tmp))
    (tmp / "cases.json").write_text(json.dumps([argv for argv, _ in cases.values()]))
    ran = run_cli([os.path.join("tests", "helpers", "train_many.py"), str(tmp / "cases.json"),
                   str(tmp / "results.json")], timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    return {name: (subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"]), words)
            for (name, (argv, words)), r in zip(cases.items(), results)}


def _case_ids():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return list(_error_cases(tmp))


@pytest.mark.parametrize("case", _case_ids())
def test_bad_input(error_results, case):
    result, words = error_results[case]
    assert_user_error(result, *words)


def test_at_least_fifteen_distinct_bad_inputs():
    assert len(_case_ids()) >= 15


def test_config_file_unknown_key_message_is_clean(error_results):
    """A locked-defaults typo in a config file should read like the override typo: the key and the fix,
    not ml_collections' repr (a dump of every field and an escaped '\\n')."""
    line = assert_user_error(error_results["config_sets_unknown_key"][0], "emb_dimm")
    assert "emb_dim" in line.replace("emb_dimm", "")  # the suggestion
    assert "\\n" not in line and "\\'" not in line, f"escaped repr in the message: {line}"
    assert "Other fields present" not in line, f"the message dumps every field: {line}"


def test_no_arguments(cli):
    result = cli(["train.py"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    # the CLI contract: a user mistake is one 'error: ' line on stderr naming the fix
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (
        f"no arguments: expected one 'error: ' line on stderr, got stderr={result.stderr!r} "
        f"(stdout starts {result.stdout[:80]!r})")
    assert "config" in lines[0]


# --------------------------------------------------------------------------------------------
# --help and config.json
# --------------------------------------------------------------------------------------------

def test_help_lists_every_key(cli):
    result = cli(["train.py", "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""
    keys = [key for key, _, _ in defaults.docs()]
    assert len(keys) == len(set(keys)) > 50
    listed = {line.split(" = ")[0].strip() for line in result.stdout.splitlines() if " = " in line}
    missing = [key for key in keys if key not in listed]
    assert not missing, f"--help does not list: {missing}"
    for _, _, meaning in defaults.docs():
        assert meaning in result.stdout


def test_help_short_flag(cli):
    result = cli(["train.py", "-h"])
    assert result.returncode == 0
    assert "train.steps" in result.stdout


def test_an_unknown_flag_in_the_environments_xla_flags_is_one_line(tmp_path):
    """XLA itself would abort at backend start with a fatal log (exit 1); the environment's XLA_FLAGS are
    checked like xla.extra_flags, and the known ones pass."""
    from conftest import run_cli

    argv = ["train.py", TINY, "run.dry_run=true", f"run.output_dir={tmp_path}"]
    bad = run_cli(argv, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_no_such_flag=true"})
    assert_user_error(bad, "XLA_FLAGS", "--xla_no_such_flag=true", "environment")
    good = run_cli(argv, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert good.returncode == 0 and "on 2 x cpu" in good.stdout, good.stderr[-2000:]


def test_resolved_config_saved_and_reloadable(cli, tmp_path, two_text_files):
    a, b = two_text_files
    out = tmp_path / "run"
    result = cli(["train.py", TINY, "run.dry_run=true", "--config.run.output_dir", str(out),
                  "--config.train.steps=7", "train.warmup_steps=2", "model.num_layers=3", f"data.text_files={a},{b}",
                  "train.learning_rate=1e-3"])
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(out / "config.json")  # a dry run writes only its own file
    with open(out / "dry_run.json") as f:
        saved = json.load(f)["config"]
    assert saved["train"]["steps"] == 7
    assert saved["train"]["warmup_steps"] == 2
    assert saved["model"]["num_layers"] == 3
    assert saved["train"]["learning_rate"] == pytest.approx(1e-3)
    assert saved["data"]["text_files"] == [a, b]
    assert saved["run"]["output_dir"] == str(out)
    assert saved["run"]["dry_run"] is True
    assert saved["model"]["emb_dim"] == 64  # from the :tiny preset
    # the file holds every key and passes validation again as a ConfigDict
    cfg = ml_collections.ConfigDict(saved)
    validate(cfg)
    from MaxOffload.config.loader import flat_keys
    assert sorted(flat_keys(cfg)) == sorted(flat_keys(defaults.get_config()))


def test_none_is_a_string_for_string_fields():
    cfg = load([QUICKSTART, "model.rope_scaling=llama3"])
    assert cfg.model.rope_scaling == "llama3"
    assert load([QUICKSTART, "model.rope_scaling=none"]).model.rope_scaling == "none"
    assert load([QUICKSTART, "hardware.peak_tflops_per_device=none"]).hardware.peak_tflops_per_device is None

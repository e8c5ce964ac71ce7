"""Hugging Face conversion without the reference implementation (tests/test_convert_hf.py has transformers):
a run's checkpoint (saved by the real Checkpointer, OCDBT) -> to-hf -> from-hf gives back every weight bit for
bit, the MTP layer and router biases included; FP8 block scales are applied; bad input is one line, exit 2,
nothing changed. These run on every stack: they catch a change in Orbax's layout (the weights writer writes it
itself, layer by layer)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import ROOT, process_env, run_cli, small_filesystem
from MaxOffload import from_config
from MaxOffload.cli import run
from MaxOffload.config.loader import load
from MaxOffload.convert.__main__ import main
from MaxOffload.convert.exporter import to_hf
from MaxOffload.convert.hf_files import CONFIG, HF_SOURCE, HFCheckpoint, ShardWriter
from MaxOffload.convert.importer import from_hf
from MaxOffload.train import rundir
from MaxOffload.train.checkpoint import Checkpointer, load_params

DEEPSEEK = ("configs/deepseek_v3.py:tiny", ("model.mtp_depth=1",))
LLAMA = ("configs/llama3_1.py:tiny", ())


def saved_run(tmp, spec, overrides, seed):
    """A run directory with one checkpoint of random weights (random router biases too), saved by the
    Checkpointer train.py uses, and its config.json. Returns (run dir, setup, the state's weights)."""
    out = os.path.join(tmp, "run")
    cfg = load([spec, *overrides, f"run.output_dir={out}", f"run.seed={seed}"])
    setup = from_config.train_setup(cfg)
    state = setup.init_state()
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    state["model_state"] = jax.tree.map(lambda b: jax.random.normal(next(keys), b.shape, b.dtype) * 0.1,
                                        state["model_state"])
    os.makedirs(out)
    checkpointer = Checkpointer(cfg, setup)
    checkpointer.save(0, state, {"step": 0})
    checkpointer.close()
    rundir.write_config(out, cfg.to_dict(), lambda _: None)
    return out, setup, {"params": state["params"], "model_state": state["model_state"]}


def assert_same_weights(a, b):
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], dict(jax.tree_util.tree_flatten_with_path(b)[0])
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        assert np.array_equal(np.asarray(leaf), np.asarray(flat_b[path])), jax.tree_util.keystr(path)


_EXPORTS = {}


def export(case, tmp_path_factory):
    """(spec, overrides, run dir, setup, weights, its float32 export in several shards), made once per module."""
    if case not in _EXPORTS:
        spec, overrides = case
        tmp = str(tmp_path_factory.mktemp("convert"))
        run_dir, setup, weights = saved_run(tmp, spec, overrides, seed=3)
        hf_dir = os.path.join(tmp, "hf")
        to_hf(run_dir, hf_dir, "float32", 60_000, say=lambda _: None)
        _EXPORTS[case] = spec, overrides, run_dir, setup, weights, hf_dir
    return _EXPORTS[case]


def imported(tmp_path_factory):
    """The Llama export imported again (config.json, hf_config.json, checkpoints/0), made once per module."""
    if "imported" not in _EXPORTS:
        spec, overrides, _, _, _, hf_dir = export(LLAMA, tmp_path_factory)
        _EXPORTS["imported"] = str(tmp_path_factory.mktemp("imported") / "weights")
        from_hf(hf_dir, spec, list(overrides), _EXPORTS["imported"], say=lambda _: None)
    return _EXPORTS["imported"]


@pytest.fixture(scope="module", params=[DEEPSEEK, LLAMA], ids=["deepseek_mtp", "llama"])
def exported(request, tmp_path_factory):
    return export(request.param, tmp_path_factory)


def test_a_run_exported_and_imported_again_keeps_every_weight(exported, tmp_path):
    """to-hf (float32) of a run's OCDBT checkpoint, then from-hf: the parameters and router biases restored by
    train.py's load_params are the saved ones, bit for bit (each layout's permutations and splits undone
    exactly); to-hf of the import writes the same tensors again (the weights writer's own layout read back)."""
    spec, overrides, _, setup, weights, hf_dir = exported
    hf = HFCheckpoint(hf_dir)
    assert len(hf.files) > 1, "the export should span several shards"
    out, lines = str(tmp_path / "weights"), []
    from_hf(hf_dir, spec, list(overrides), out, say=lines.append)
    restored, step = load_params(out, setup)
    assert step == 0
    assert_same_weights(weights, restored)
    assert "train from these weights:" in lines[-1] and f"checkpoint.load_params_from={out}" in lines[-1]
    again = str(tmp_path / "hf_again")
    to_hf(out, again, "float32", 10**9, say=lines.append)
    second = HFCheckpoint(again)
    assert sorted(second.tensors) == sorted(hf.tensors)
    for name in hf.tensors:
        assert np.array_equal(hf.raw(name), second.raw(name)), name
    with open(os.path.join(again, CONFIG)) as f, open(os.path.join(hf_dir, CONFIG)) as g:
        assert json.load(f) == json.load(g)


def test_the_mtp_layer_is_exported_as_layer_num_layers_and_skipped_with_a_note_without_mtp(tmp_path_factory, tmp_path):
    spec, overrides, *_, hf_dir = export(DEEPSEEK, tmp_path_factory)
    hf = HFCheckpoint(hf_dir)
    assert hf.config["num_nextn_predict_layers"] == 1
    mtp = sorted(n for n in hf.tensors if n.startswith("model.layers.3."))
    assert "model.layers.3.eh_proj.weight" in mtp and "model.layers.3.shared_head.head.weight" in mtp
    assert np.array_equal(hf.raw("model.layers.3.embed_tokens.weight"), hf.raw("model.embed_tokens.weight"))
    lines = []
    from_hf(hf_dir, spec, ["model.mtp_depth=0"], str(tmp_path / "main_only"), say=lines.append)
    note = next(line for line in lines if "note:" in line)
    assert "model.layers.3.*" in note and "multi-token-prediction module, skipped" in note, note


def quantize(w, block):
    """float8 e4m3 blocks and their float32 scales (scale = the block's max |w| / 448, e4m3's largest value)."""
    rows, cols = w.shape
    b0, b1 = block
    scale = np.ones((-(-rows // b0), -(-cols // b1)), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = max(np.abs(w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]).max() / 448, 1e-12)
    expanded = np.kron(scale, np.ones(block, np.float32))[:rows, :cols]
    q = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
    return q, scale, q.astype(np.float32) * expanded


def rewrite(src, dst, tensors=lambda name, value: [(name, value)], config=lambda c: c):
    """A copy of the Hugging Face checkpoint `src` whose tensors and config.json are passed through the edits."""
    hf = HFCheckpoint(src)
    writer = ShardWriter(dst, 100_000)
    for name in sorted(hf.tensors):
        for new_name, value in tensors(name, hf.raw(name)):
            writer.add(new_name, value)
    writer.close()
    with open(os.path.join(dst, CONFIG), "w") as f:
        json.dump(config(dict(hf.config)), f)
    return dst


def test_fp8_weights_are_dequantised_by_their_block_scales(exported, tmp_path):
    """DeepSeek-V3's released layout: every linear weight float8 e4m3 with a `weight_scale_inv` per block (8x8
    here, with partial blocks at the edges). The import equals the import of the same weights dequantised by
    the test itself (w x scale_inv, block by block)."""
    spec, overrides, *_, hf_dir = exported
    block = (8, 8)
    dequantized = {}

    def fp8(name, value):
        if value.ndim == 2 and name.endswith("proj.weight") and "embed" not in name:
            q, scale, dequantized[name] = quantize(value, block)
            return [(name, q), (name + "_scale_inv", scale)]
        return [(name, value)]

    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    fp8_dir = rewrite(hf_dir, str(tmp_path / "fp8"), fp8, lambda c: {**c, "quantization_config": quantization})
    assert dequantized and HFCheckpoint(fp8_dir).tensors[next(iter(dequantized))][1] == np.dtype(ml_dtypes.float8_e4m3fn)
    reference_dir = rewrite(hf_dir, str(tmp_path / "reference"),
                            lambda name, value: [(name, dequantized.get(name, value))])
    original = HFCheckpoint(hf_dir).raw(next(iter(dequantized)))
    assert not np.array_equal(dequantized[next(iter(dequantized))], original)  # the quantisation did something
    setup = from_config.train_setup(load([spec, *overrides]))
    imported = {}
    for label, directory in (("fp8", fp8_dir), ("reference", reference_dir)):
        out = str(tmp_path / f"weights_{label}")
        from_hf(directory, spec, list(overrides), out, say=lambda _: None)
        imported[label] = load_params(out, setup)[0]
    assert_same_weights(imported["reference"], imported["fp8"])


def one_line_error(argv, capsys):
    code = run(main, argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, (code, err)
    return err


def test_bad_checkpoints_are_one_line_and_change_nothing(exported, tmp_path, capsys):
    spec, overrides, run_dir, _, _, hf_dir = exported
    out = str(tmp_path / "out")

    def args(directory, *extra):
        return ["from-hf", directory, "--config", spec, *overrides, *extra, "--out", out]
    some = sorted(n for n in HFCheckpoint(hf_dir).tensors if n.endswith("o_proj.weight"))[0]

    missing = rewrite(hf_dir, str(tmp_path / "missing"), lambda n, v: [] if n == some else [(n, v)])
    assert f"has no tensor {some}" in one_line_error(args(missing), capsys)
    wrong = rewrite(hf_dir, str(tmp_path / "wrong"), lambda n, v: [(n, v[:, :-1] if n == some else v)])
    assert f"tensor {some} (shape" in one_line_error(args(wrong), capsys)
    other = rewrite(hf_dir, str(tmp_path / "other"), config=lambda c: {**c, "architectures": ["MistralForCausalLM"]})
    assert "MistralForCausalLM, an architecture this project does not import" in one_line_error(
        args(other), capsys)
    field = "norm_topk_prob" if overrides else "attention_bias"
    unsupported = rewrite(hf_dir, str(tmp_path / "unsupported"), config=lambda c: {**c, field: not c.get(field, False)})
    assert f"config.json has {field}=" in one_line_error(args(unsupported), capsys)
    assert "contradicts" in one_line_error(args(hf_dir, "model.emb_dim=128"), capsys)
    truncated = shutil.copytree(hf_dir, str(tmp_path / "truncated"))
    shard = os.path.join(truncated, HFCheckpoint(hf_dir).files[-1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    assert "not a readable safetensors shard" in one_line_error(args(truncated), capsys)
    assert not os.path.exists(out), "a failed import must leave nothing behind"
    # an --out that already holds weights is refused, and left as it was
    assert run(main, args(hf_dir)) == 0
    capsys.readouterr()
    before = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert "is not empty; nothing was changed" in one_line_error(args(hf_dir), capsys)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == before
    # export: a damaged checkpoint is found before anything is written
    chunk = next(os.path.join(root, name) for root, _, names in os.walk(os.path.join(out, "checkpoints", "0", "state"))
                 for name in names if not name.startswith((".", "_")))
    with open(chunk, "r+b") as f:
        f.seek(0)
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    exported_to = str(tmp_path / "exported")
    assert "is damaged" in one_line_error(["to-hf", out, "--out", exported_to], capsys)
    assert not os.path.exists(exported_to)
    assert "not empty" in one_line_error(["to-hf", run_dir, "--out", hf_dir], capsys)


def edit_header(src, dst, edit):
    """A copy of checkpoint `src` whose every shard's safetensors header (the parsed JSON) went through
    edit(header, shard name) -> the header to write (any JSON); the tensors' bytes stay as they were."""
    shutil.copytree(src, dst)
    for name in HFCheckpoint(src).files:
        path = os.path.join(dst, name)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header, data = json.loads(f.read(n)), f.read()
        raw = json.dumps(edit(header, name)).encode()
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + data)
    return dst


def edit_json(src, dst, name, edit):
    """A copy of checkpoint `src` whose JSON file `name` went through edit(parsed) -> what to write."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, name)) as f:
        parsed = json.load(f)
    with open(os.path.join(dst, name), "w") as f:
        json.dump(edit(parsed), f)
    return dst


def test_hostile_checkpoints_are_one_line_and_never_converted(tmp_path_factory, tmp_path, capsys):
    """What a format reader must refuse: a tensor whose offsets point at another's bytes (it would silently get
    those weights), an integer tensor relabelled as weights, malformed headers, index files and config.json
    fields; each one line, exit 2, no output."""
    spec, overrides, _, _, _, hf_dir = export(LLAMA, tmp_path_factory)
    out = str(tmp_path / "out")
    hf = HFCheckpoint(hf_dir)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert hf.tensors[q][0] == hf.tensors[o][0] and hf.shape(q) == hf.shape(o)  # one shard, the same size

    def header(label, edit):
        return edit_header(hf_dir, str(tmp_path / label), lambda h, shard: edit(h) if q in h else h)

    def refused(directory, *expected):
        err = one_line_error(["from-hf", directory, "--config", spec, *overrides, "--out", out], capsys)
        assert all(e in err for e in expected), err
        assert not os.path.exists(out)

    aliased = header("aliased", lambda h: {**h, q: {**h[q], "data_offsets": h[o]["data_offsets"]}})
    refused(aliased, "not a readable safetensors shard", f"tensor {q}'s bytes", f"overlap tensor {o}'s")
    refused(header("relabelled", lambda h: {**h, q: {**h[q], "dtype": "I32"}}), f"tensor {q} is stored as I32")
    refused(header("strings", lambda h: {**h, q: {**h[q], "data_offsets": [str(x) for x in h[q]["data_offsets"]]}}),
            f"tensor {q}'s data_offsets", "are not two byte offsets")
    refused(header("list", lambda h: list(h)), "its header is a JSON list, not an object of tensors")
    refused(header("gap", lambda h: {k: v for k, v in h.items() if k != q}), "belong to no tensor")
    refused(edit_json(hf_dir, str(tmp_path / "index"), "model.safetensors.index.json",
                      lambda i: {**i, "weight_map": {k: 3 for k in i["weight_map"]}}), "places", "in 3, not a safetensors")
    refused(edit_json(hf_dir, str(tmp_path / "escape"), "model.safetensors.index.json",
                      lambda i: {**i, "weight_map": {k: "../" + v for k, v in i["weight_map"].items()}}), "not a safetensors file beside it")
    refused(edit_json(hf_dir, str(tmp_path / "config_list"), CONFIG, lambda c: [c]),
            "config.json: the file should be an object, got an array; download or copy it again")
    cut = shutil.copytree(hf_dir, str(tmp_path / "config_cut"))
    with open(os.path.join(cut, CONFIG), "r+") as f:
        f.truncate(40)
    refused(cut, f"{cut}/config.json: not valid JSON (")
    refused(edit_json(hf_dir, str(tmp_path / "heads"), CONFIG, lambda c: {**c, "num_attention_heads": 0}),
            "config.json's num_attention_heads is 0; it must be an integer >= 1")
    refused(edit_json(hf_dir, str(tmp_path / "eps"), CONFIG, lambda c: {**c, "rms_norm_eps": "1e-5"}),
            "config.json's rms_norm_eps is '1e-5'; it must be a finite number >= 0")
    llama3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    refused(edit_json(hf_dir, str(tmp_path / "rope"), CONFIG, lambda c: {**c, "rope_parameters": llama3}),
            "rope_parameters has no factor, which its rope type 'llama3' needs")


def test_a_conversion_never_writes_into_its_source_or_what_it_did_not_create(tmp_path_factory, tmp_path, capsys):
    spec, overrides, run_dir, _, _, hf_dir = export(LLAMA, tmp_path_factory)
    before = {name: open(os.path.join(hf_dir, name), "rb").read() for name in os.listdir(hf_dir)}
    os.symlink(hf_dir, tmp_path / "link")
    (tmp_path / "file").write_text("mine")
    for out, why in ((hf_dir, "is, contains or lies inside the source"),
                     (os.path.join(hf_dir, "converted"), "is, contains or lies inside the source"),
                     (str(tmp_path / "link"), "is a symbolic link"), (str(tmp_path / "file"), "is a file")):
        err = one_line_error(["from-hf", hf_dir, "--config", spec, *overrides, "--out", out], capsys)
        assert why in err, err
    assert {name: open(os.path.join(hf_dir, name), "rb").read() for name in os.listdir(hf_dir)} == before
    assert (tmp_path / "file").read_text() == "mine"
    assert "lies inside the source" in one_line_error(["to-hf", run_dir, "--out", os.path.join(run_dir, "hf")], capsys)
    # directories beside --out that look like a conversion's leftovers but were not made by one stay
    out = tmp_path / "exported"
    for name in ("exported.partial", "exported.partial-someone"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text("mine")
    assert run(main, ["to-hf", run_dir, "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("exported.")) == \
        ["exported.partial", "exported.partial-someone"]


def _written(path):
    try:
        return os.path.getsize(path) > 0
    except OSError:  # not yet, or no longer (a conversion removes its marker as it finishes)
        return False


def _stopped_mid_conversion(argv, out):
    """A `python -m MaxOffload.convert ARGV` process frozen (SIGSTOP) while its staging directory beside `out`
    exists with its marker in it, i.e. mid-conversion (stopped between the directory and its marker, a killed
    conversion leaves a directory nothing proves is its own, which a rerun rightly leaves alone); retried when a
    conversion outruns the polling."""
    from MaxOffload.convert.staging import MARKER

    pattern, where = os.path.basename(out) + ".partial-", os.path.dirname(out)
    for _ in range(5):
        process = subprocess.Popen([sys.executable, "-m", "MaxOffload.convert", *argv], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=process_env(["python"]))
        while process.poll() is None:
            if any(n.startswith(pattern) and _written(os.path.join(where, n, MARKER)) for n in os.listdir(where)):
                process.send_signal(signal.SIGSTOP)
                return process
            time.sleep(0.002)
        assert process.returncode == 0, process.communicate()[1]
        shutil.rmtree(out)
    raise AssertionError("the conversion always finished before it could be stopped")


def test_signals_leave_nothing_behind_and_a_killed_conversion_reruns(tmp_path_factory, tmp_path):
    """SIGTERM and Ctrl-C (SIGINT) mid-conversion: one line, exit 128 + the signal, no output, no staging
    directory. kill -9: the staging directory stays, and the same command run again removes it (one line) and
    completes."""
    spec, overrides, _, _, _, hf_dir = export(LLAMA, tmp_path_factory)
    out = str(tmp_path / "weights")
    argv = ["from-hf", hf_dir, "--config", spec, *overrides, "--out", out]
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        process = _stopped_mid_conversion(argv, out)
        process.send_signal(sig)
        process.send_signal(signal.SIGCONT)
        _, err = process.communicate(timeout=120)
        assert process.returncode == code and err.strip() == f"interrupted by {sig.name}; {out} was not written " \
            "(its partial output was removed)", (process.returncode, err)
        assert os.listdir(tmp_path) == []
    process = _stopped_mid_conversion(argv, out)
    process.kill()
    process.communicate(timeout=120)
    [left] = os.listdir(tmp_path)
    assert left.startswith("weights.partial-") and not os.path.exists(out)
    again = run_cli(["-m", "MaxOffload.convert", *argv])
    assert again.returncode == 0, again.stderr
    assert f"removed {tmp_path / left}, the partial output of an interrupted conversion" in again.stdout
    assert os.listdir(tmp_path) == ["weights"] and os.path.isdir(os.path.join(out, "checkpoints", "0", "state"))


def test_an_export_whose_checkpoint_its_run_removes_says_so(tmp_path_factory, tmp_path):
    """A live run deletes its older checkpoints (checkpoint.keep) while to-hf may be reading one: one line that
    the run removed it, never that it is damaged, and no output."""
    _, _, run_dir, _, _, _ = export(LLAMA, tmp_path_factory)
    run_copy = shutil.copytree(run_dir, str(tmp_path / "run"))
    out = str(tmp_path / "hf")
    process = _stopped_mid_conversion(["to-hf", run_copy, "--out", out], out)
    shutil.rmtree(os.path.join(run_copy, "checkpoints", "0"))  # what the trainer's retention does
    process.send_signal(signal.SIGCONT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and err.strip().splitlines() == [
        f"error: checkpoint {run_copy}/checkpoints/0 was removed by its run while it was exported (a training run "
        "keeps its newest checkpoint.keep checkpoints); nothing was written: export the run's newest checkpoint "
        "again"], err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_full_or_read_only_filesystem_is_one_line_and_leaves_nothing(tmp_path_factory, tmp_path, capsys):
    spec, overrides, run_dir, _, _, hf_dir = export(LLAMA, tmp_path_factory)  # 0.6 MiB of float32 weights
    disk = str(tmp_path / "disk")
    with small_filesystem(disk, "256k"):
        for argv in (["from-hf", hf_dir, "--config", spec, *overrides], ["to-hf", run_dir, "--dtype", "float32"]):
            err = one_line_error([*argv, "--out", os.path.join(disk, "out")], capsys)
            assert err == f"error: cannot write {disk}/out (No space left on device); nothing was written: free " \
                "space or give a writable --out"
            assert os.listdir(disk) == []
    with small_filesystem(disk, "1m", read_only=True):
        err = one_line_error(["from-hf", hf_dir, "--config", spec, *overrides, "--out", os.path.join(disk, "out")],
                             capsys)
        assert "(Read-only file system); nothing was written" in err


def test_the_command_documents_both_directions_and_bad_input_is_one_line_without_a_traceback(tmp_path):
    help_text = run_cli(["-m", "MaxOffload.convert", "--help"])
    assert help_text.returncode == 0
    for words in ("from-hf HF_DIR --config", "to-hf SOURCE --out HF_DIR", "checkpoint.load_params_from=DIR",
                  "--dtype", "--max_shard_size"):
        assert words in help_text.stdout, words
    result = run_cli(["-m", "MaxOffload.convert", "from-hf", str(tmp_path), "--config", "configs/llama3_1.py:tiny",
                      "--out", str(tmp_path / "out")])
    assert result.returncode == 2 and result.stderr.strip() == f"error: {tmp_path} has no config.json; give the " \
        "directory save_pretrained (or a download) wrote", result.stderr
    assert run_cli(["-m", "MaxOffload.convert", "sideways"]).returncode == 2


def _contents(directory):
    return {os.path.relpath(os.path.join(root, n), directory): open(os.path.join(root, n), "rb").read()
            for root, _, names in os.walk(directory) for n in names}


def _without_model(text):
    return json.dumps({k: v for k, v in json.loads(text).items() if k != "model"})


def _num_layers_a_string(text):
    config = json.loads(text)
    config["model"]["num_layers"] = str(config["model"]["num_layers"])
    return json.dumps(config)


DAMAGED = {"hf_config_cut_short": (HF_SOURCE, lambda text: text[:len(text) // 2], "not valid JSON ("),
           "hf_config_a_list": (HF_SOURCE, lambda text: "[]", "the file should be an object, got an array"),
           "config_cut_short": (CONFIG, lambda text: text[:-2], "not valid JSON ("),
           "config_without_model": (CONFIG, _without_model, "missing key 'model'"),
           "config_num_layers_a_string": (CONFIG, _num_layers_a_string,
                                          "'model.num_layers' should be an integer, got a string (")}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_to_hf_from_a_run_with_a_damaged_json_file_is_one_line_and_writes_nothing(tmp_path_factory, tmp_path, case):
    """The run's config.json (its model) or from-hf's hf_config.json (what the export carries over) cut short, of
    another type or missing a key: one line naming the file and what is wrong, exit 2, nothing written."""
    name, damage, words = DAMAGED[case]
    run_dir = shutil.copytree(imported(tmp_path_factory), str(tmp_path / "run"))
    path = os.path.join(run_dir, name)
    with open(path) as f:
        text = damage(f.read())
    with open(path, "w") as f:
        f.write(text)
    before = _contents(run_dir)
    result = run_cli(["-m", "MaxOffload.convert", "to-hf", run_dir, "--out", str(tmp_path / "hf")])
    err = result.stderr.strip()
    assert result.returncode == 2 and "Traceback" not in result.stdout + err and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}: {words}"), err
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no output, no staging directory
    assert _contents(run_dir) == before


def test_a_config_json_of_older_transformers_reads_alike(exported, tmp_path):
    """The released checkpoints' config.json (transformers 4) spells RoPE as `rope_scaling` + `rope_theta`
    (DeepSeek-V3's with "type": "yarn"), transformers 5 as `rope_parameters`: both give the same model."""
    spec, overrides, *_, hf_dir = exported

    def legacy(config):
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type") not in (None, "default"):
            config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
        return config

    older = rewrite(hf_dir, str(tmp_path / "older"), config=legacy)
    assert "rope_parameters" not in HFCheckpoint(older).config
    printed = {}
    for label, directory in (("new", hf_dir), ("old", older)):
        lines = []
        from_hf(directory, spec, list(overrides), str(tmp_path / label), say=lines.append)
        printed[label] = lines[-1].replace(str(tmp_path / label), "DIR")
        with open(tmp_path / label / "config.json") as f:
            printed[label] += json.dumps(json.load(f)["model"], sort_keys=True)
    assert printed["old"] == printed["new"]

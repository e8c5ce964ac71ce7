"""Hugging Face checkpoints in and out.

    python -m MaxOffload.convert from-hf HF_DIR --config CONFIG.py[:ARG] [key=value ...] --out DIR
    python -m MaxOffload.convert to-hf SOURCE --out HF_DIR [--dtype bfloat16] [--max_shard_size 5GB]

from-hf  reads a Hugging Face checkpoint (config.json + safetensors shards, e.g. a download of
         meta-llama/Llama-3.1-8B or deepseek-ai/DeepSeek-V3) and writes this project's weights to
         DIR/checkpoints/0 (an Orbax checkpoint) and the resolved config to DIR/config.json. The model's
         dimensions come from config.json (LlamaForCausalLM, DeepseekV3ForCausalLM); CONFIG and the
         overrides give the rest (dtypes, training, remat/offload), and an override that contradicts
         config.json is an error. DeepSeek-V3's float8 weights are dequantised by their 128x128 block scales;
         its multi-token-prediction layer (61) is loaded when model.mtp_depth=1 (the 671b config) and
         skipped with a note when model.mtp_depth=0. Tensors are read one at a time and written one layer at
         a time: memory stays about one layer's parameters, never the whole model. It ends by printing the
         command that trains from the weights:
             python train.py CONFIG ... checkpoint.load_params_from=DIR
to-hf    writes SOURCE's weights as a Hugging Face checkpoint that transformers loads: safetensors shards of
         at most --max_shard_size (default 5GB), model.safetensors.index.json and config.json, in --dtype
         (bfloat16 | float32 | float16; default bfloat16). SOURCE: a run directory (its newest checkpoint),
         one of its step directories (RUN_DIR/checkpoints/STEP) or a from-hf output; the model comes from
         the config.json beside its checkpoints/. One layer at a time, like from-hf.

Exit status 0 done, 2 bad input (one line: a missing tensor, a shape that does not fit config.json, an
architecture or config.json field this project cannot train, a damaged shard or checkpoint, an --out that
is not new); nothing is changed then.
"""
import sys

from MaxOffload.cli import run
from MaxOffload.errors import ConfigError

SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text, option="--max_shard_size"):
    upper = text.strip().upper()
    for unit, factor in SIZE_UNITS.items():
        if upper.endswith(unit):
            upper, scale = upper[:-len(unit)], factor
            break
    else:
        scale = 1
    try:
        value = int(float(upper) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf
        value = 0
    if value <= 0:
        raise ConfigError(f"{option} {text}: give a size such as 5GB, 500MB or a number of bytes")
    return value


def options(argv, valued):
    """(positional arguments, {option: value}) with --name VALUE or --name=VALUE for the `valued` names."""
    rest, values, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in valued:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value: {name} VALUE")
                i, value = i + 1, argv[i + 1]
            values[name] = value
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {name}: this command takes {', '.join(valued)} (see --help)")
        else:
            rest.append(arg)
        i += 1
    return rest, values


def main(argv):
    if not argv:
        raise ConfigError("no command given: from-hf or to-hf (see --help)")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    command, argv = argv[0], argv[1:]
    if command == "from-hf":
        rest, values = options(argv, ("--config", "--out"))
        if not rest or "--config" not in values or "--out" not in values:
            raise ConfigError("from-hf needs HF_DIR, --config CONFIG.py[:ARG] and --out DIR (see --help)")
        from MaxOffload.convert.importer import from_hf

        return from_hf(rest[0], values["--config"], rest[1:], values["--out"])
    if command == "to-hf":
        rest, values = options(argv, ("--out", "--dtype", "--max_shard_size"))
        if len(rest) != 1 or "--out" not in values:
            raise ConfigError("to-hf needs one SOURCE (a run or step directory) and --out HF_DIR (see --help)")
        from MaxOffload.convert.exporter import to_hf

        return to_hf(rest[0], values["--out"], values.get("--dtype", "bfloat16"),
                     parse_size(values.get("--max_shard_size", "5GB")))
    raise ConfigError(f"unknown command {command!r}: from-hf or to-hf (see --help)")


if __name__ == "__main__":
    sys.exit(run(main))

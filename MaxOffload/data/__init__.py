"""Training data: a batch is a pure function of (seed, step), so runs are reproducible.

A batch is a dict of numpy arrays [rows, seq_len]: `inputs` and `targets` (int32 token
ids, targets = inputs shifted by one) and `mask` (float32, 0 where the loss must ignore
a position, e.g. padding); with data.attend_within_documents, `documents` (int32: which of
the documents packed into its row each input token belongs to, from the end-of-text tokens).

Sources (data.source): `text` (text.py: byte-level tokens of data.text_files or the bundled
docs, built in memory), `tokens` (tokenized.py: a directory written by
`python -m MaxOffload.data.prepare`, memory-mapped) -- both read by tokenized.TokenWindows --
and `synthetic` (seeded random tokens). The submodules are imported on use, so that
`python -m MaxOffload.data.prepare` starts without JAX.
"""


def build(cfg, process_index=0, process_count=1):
    """The configured dataset, yielding this process's rows of each global batch."""
    import jax

    from MaxOffload.data import synthetic, text, tokenized

    from MaxOffload.parallel.mesh import sequences

    global_batch = sequences(cfg.train.per_device_batch_size, jax.device_count())
    kwargs = dict(global_batch=global_batch, seq_len=cfg.train.seq_len, seed=cfg.run.seed,
                  process_index=process_index, process_count=process_count)
    if cfg.data.source == "synthetic":
        return synthetic.SyntheticData(vocab_size=cfg.model.vocab_size, **kwargs)
    if cfg.data.source == "tokens":
        return tokenized.TokenizedData(cfg.data.path, documents=cfg.data.attend_within_documents, **kwargs)
    return text.TextData(text.load_documents(list(cfg.data.text_files)), eval_fraction=cfg.data.eval_fraction,
                         attend_within_documents=cfg.data.attend_within_documents, **kwargs)


def micro_batches(data, step, k):
    """The k micro-batches of training step `step` (0-based): micro-batch i is the dataset's batch step x k + i.
    Every source numbers its sequences by their place in the run, so these are the rows of one batch of k x the
    micro-batch's rows."""
    return [data.train_batch(step * k + i) for i in range(k)]

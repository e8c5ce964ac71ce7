"""What every decoder family shares: layers stacked for a scan and run segment by segment under their
remat/offload policies, the per-layer host-to-device copy of host-resident weights, and the body around the
layers (token embedding in, final norm and unembedding out)."""
import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components, cross_entropy
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, RMSNorm, param
from MaxOffload.models.model_context import ModelContext
from MaxOffload.models.positions import Positions
from MaxOffload.parallel import pipeline


def stacked_layers(make_layer, num_layers, rngs, schedule=None):
    """`num_layers` layers with their parameters stacked on a leading `layers` axis (for scan). With a schedule (a
    parallel/pipeline.Pipeline), the stack is the pipelined one: its leading axis is `stage_layers` (split over the
    stage mesh axis) and holds the layers in the pipeline's order (Pipeline.order; each layer initialised as
    without stages)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: "layers" if schedule is None else "stage_layers"})
    def create(rngs):
        return make_layer(rngs)

    layers = create(rngs)
    if schedule is None or schedule.repeats == 1:
        return layers
    graphdef, state = nnx.split(layers)
    order = schedule.order(num_layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[order], state))


def run_layers(layers, x, positions, segments, scan, params_on_host=False, with_outputs=False, per_layer=None,
               layout=None):
    """Applies stacked `layers` to x, segment by segment.

    segments: ((start, stop, policy, label), ...) covering the layers in order; each segment
    is one `jax.checkpoint` with its own remat/offload policy, traced under the name scope
    `label` (offload/inspect.py reads it back). scan=False runs a Python loop over the same
    stacked parameters (for tests and debugging). params_on_host: the stacked parameters live
    in pinned host memory and each layer's slice is copied to the device inside the scan, so
    only the current layer's weights need HBM.

    A layer returns h, or (h, outputs) with per-layer outputs (e.g. MoE expert loads);
    with_outputs=True returns (x, outputs stacked over all layers on a leading axis). per_layer: an array
    with one entry per layer on its leading axis, passed to each layer as a third argument (the MTP depths'
    next-token embeddings). layout: the model's ParallelLayout when this is the pipelined stack
    (stacked_layers(..., schedule)): its layers run in the pipeline's stages (parallel/pipeline.run), x holding a
    step's micro-batches, one segment (policy) for the whole stack, the outputs summed over the micro-batches and
    in the stack's stored order.
    """
    graphdef, stacked = nnx.split(layers)
    if layout is not None and layout.pipeline is not None:
        if len(segments) != 1:
            raise ValueError("the pipelined stack runs one remat segment (one policy for its layers)")
        (_, _, policy, label), = segments

        if positions.document is not None:  # TrainSetup refuses this: said here for direct callers
            raise ValueError("pipeline stages run every row at one set of positions: no documents within rows")

        def stage_fn(weights, h, rows_positions):
            return _segments(graphdef, weights, h, Positions(rows_positions), ((0, _depth(weights), policy, label),),
                             scan, params_on_host, None)

        x, outputs = pipeline.run(layout.pipeline, layout.mesh, stage_fn, stacked, x, positions.index[0])
        return (x, outputs) if with_outputs else x
    x, outputs = _segments(graphdef, stacked, x, positions, segments, scan, params_on_host, per_layer)
    return (x, outputs) if with_outputs else x


def _segments(graphdef, stacked, x, positions, segments, scan, params_on_host, per_layer):
    """(x after the stacked layers' segments, their per-layer outputs stacked): run_layers' body."""

    def body(h, xs):
        layer_state, extra = xs
        layer = nnx.merge(graphdef, to_device(layer_state, params_on_host))
        out = layer(h, positions) if per_layer is None else layer(h, positions, extra)
        return out if isinstance(out, tuple) else (out, None)

    outputs = []
    for start, stop, policy, label in segments:
        whole = (start, stop) == (0, _depth(stacked))
        segment_state = (stacked, per_layer) if whole else \
            jax.tree.map(lambda p: p[start:stop], (stacked, per_layer))
        step = jax.checkpoint(body, policy=policy, prevent_cse=not scan)
        with jax.named_scope(label):
            if scan:
                x, ys = jax.lax.scan(step, x, segment_state)
            else:
                layer_outputs = []
                for i in range(stop - start):
                    x, y = step(x, jax.tree.map(lambda p: p[i], segment_state))
                    layer_outputs.append(y)
                ys = jax.tree.map(lambda *a: jnp.stack(a), *layer_outputs)
        outputs.append(ys)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *outputs)


def to_device(tree, enabled=True):
    """Copies host-resident values into device memory inside a jitted step (no-op when not enabled)."""
    return jax.device_put(tree, jax.memory.Space.Device) if enabled else tree


def on_device(module, enabled=True):
    """The module with its parameters copied to device memory (itself when not enabled)."""
    if not enabled:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, to_device(state))


def _depth(stacked):
    return jax.tree.leaves(stacked)[0].shape[0]


class DecoderModel(nnx.Module):
    """embed -> (the family's layers) -> final norm -> unembed. A family's __init__ calls init_embeddings
    before building its layers and init_head after (parameter creation order fixes the random init), and its
    `hidden` runs its layers after embed_tokens; __call__ gives the logits, `losses` the training loss's terms
    (the cross-entropy tile by tile over the vocabulary: model.vocab_tiles, models/cross_entropy.py)."""

    def init_embeddings(self, c, params_on_host, rngs, ctx=None):
        """ctx: the models/model_context.ModelContext the model is built with (its parallel layout and weight
        matmuls' numerics; default: no mesh, bf16 in the configured compute dtype)."""
        self.config = c
        self.params_on_host, self.ctx = params_on_host, ctx or ModelContext.of(c)
        self.embed = param(rngs, (c.vocab_size, c.emb_dim), ("vocab", "embed"), jnp.dtype(c.param_dtype), c.init_std)

    def init_head(self, c, rngs):
        pdt = jnp.dtype(c.param_dtype)
        self.final_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        if not c.tie_embeddings:
            self.unembed = param(rngs, (c.emb_dim, c.vocab_size), ("embed", "vocab"), pdt, c.init_std)

    def next_model_state(self, statistics):
        """The model's non-Param variables after a step with these aux "statistics" (additive over micro-batches);
        unchanged by default (a family with state of its own, e.g. router biases, updates it)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Not(nnx.Param)))

    def hidden(self, tokens, documents=None):
        """tokens [batch, length] int32 (documents: as losses takes them) -> (the normalised final hidden states
        [batch, length, emb] in the layout's token order, the embedding table on the device, aux: what target_losses
        consumes and the step's extras, as train/step.TrainSetup.forward lists them)."""
        raise NotImplementedError(f"{type(self).__name__} gives hidden(tokens, documents) -> (hidden states, "
                                  "embedding, aux)")

    def losses(self, tokens, targets, mask, documents=None):
        """(sum of next-token cross-entropy over the positions where mask=1, their number, this family's losses of
        the targets (target_losses), aux): the training loss's terms, no logits kept whole (cross_entropy).
        documents [batch, length]: which document of its row each token belongs to (embed_tokens), or None."""
        x, embed, aux = self.hidden(tokens, documents)
        extra, aux = self.target_losses(aux, targets, mask, embed)
        return (*self.cross_entropy(x, embed, *self.laid_out(targets, mask)), extra, aux)

    def target_losses(self, aux, targets, mask, embed):
        """(this family's losses of the targets beyond next-token cross-entropy, added to the objective; aux with
        what they consumed removed and their metrics added). None by default. `embed`: the embedding table on the
        device (the output head, when tied)."""
        return 0.0, aux

    def embed_tokens(self, tokens, documents=None):
        """tokens [batch, length] int32 -> (x [batch, length, emb] in the compute dtype, positions (models/positions.
        Positions, with `documents` [batch, length], which document of its row each token belongs to, or None), the
        embedding table on the device). x and positions are in the layout's token order (load balancing over
        the context axes reorders the sequence; parallel/layout.token_order): the layers see each token's global
        position, and the logits come out in that order too (the loss lays its targets out the same way:
        `laid_out`), so no hidden state ever moves between context shards for the order."""
        cdt = jnp.dtype(self.config.compute_dtype)
        order = self.ctx.layout.token_order(tokens.shape[1])
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32) if order is None else jnp.asarray(order)
        positions = Positions(jnp.broadcast_to(positions, tokens.shape),
                              None if documents is None else self.in_layout_order(documents))
        tokens = self.in_layout_order(tokens)
        embed = to_device(self.embed[...], self.params_on_host)
        return self.ctx.constrain(jnp.take(embed, tokens, axis=0).astype(cdt), BATCH_LENGTH_EMBED), positions, embed

    def in_layout_order(self, tokens):
        """tokens [..., batch, length] in the layout's token order (embed_tokens), placed as the batch is: left to
        XLA, the reordered tokens stay whole on every device and the embedding lookup with them (gathered, then
        re-split: a full rematerialization of [batch, length, emb])."""
        order = self.ctx.layout.token_order(tokens.shape[-1])
        if order is None:
            return tokens
        axes = (None,) * (tokens.ndim - 2) + ("activation_batch", "activation_length")
        return self.ctx.constrain(jnp.take(tokens, order, axis=-1), axes)

    def laid_out(self, *arrays):
        """[..., length] arrays of the sequence (the targets, the mask) in the layout's token order, the order of the
        model's logits: a few bytes a token where putting the logits or the hidden states back in sequence order
        would move them between the context shards."""
        return tuple(self.in_layout_order(a) for a in arrays)

    def final_normed(self, x):
        return on_device(self.final_norm, self.params_on_host)(x)

    @components.scoped(components.UNEMBED)
    def unembed_normed(self, x, embed):
        """Normalised hidden states [..., length, emb] -> logits [..., length, vocab] float32 (the output head,
        which multi-token prediction shares), in the layout's token order (embed_tokens)."""
        return self.logits_of(x, self.head(embed))

    def head(self, embed):
        """The output head [emb, vocab] on the device: the embedding table's transpose when tied."""
        return embed.T if self.config.tie_embeddings else to_device(self.unembed[...], self.params_on_host)

    def logits_of(self, x, head):
        """x [..., length, emb] times `head` [emb, columns] (the whole head or a tile of it): float32 logits."""
        logits = self.ctx.dense(x, head, "...le,ev->...lv", components.UNEMBED)
        batch_axes = (None,) * (logits.ndim - 3) + ("activation_batch",)
        return self.ctx.constrain(logits, (*batch_axes, "activation_length", "activation_vocab"))

    def cross_entropy(self, x, embed, targets, mask):
        """(sum, count) of next-token cross-entropy of normalised hidden states x [batch, length, emb] against
        targets and mask [batch, length], all in the layout's token order (laid_out): through the whole logits
        (unembed_normed), or vocabulary tile by tile under model.vocab_tiles (models/cross_entropy.tiled)."""
        tiles, shards = cross_entropy.tiles_under(self.config, self.ctx.layout)
        if tiles == 1:
            return cross_entropy.masked(self.unembed_normed(x, embed), targets, mask)
        with jax.named_scope(components.UNEMBED):
            return cross_entropy.tiled(x, self.head(embed), targets, mask, tiles, self.logits_of, shards)


class SingleStackDecoder(DecoderModel):
    """A family whose layers are one scanned stack of identical layers (the model group "decoder"): it gives
    `make_layer(config, rngs, ctx)` and gets the constructor every family takes and the forward pass."""

    PIPELINED_STACK = "layers"  # the attribute holding the stack that pipeline stages split (pipelined_group)

    @staticmethod
    def make_layer(c, rngs, ctx):
        raise NotImplementedError("a SingleStackDecoder gives make_layer(config, rngs, ctx) -> one layer")

    def __init__(self, c, *, remat_segments, params_on_host=False, rngs, ctx=None):
        """ctx: as DecoderModel.init_embeddings says."""
        self.remat_segments = remat_segments["decoder"]
        self.init_embeddings(c, params_on_host, rngs, ctx)
        self.layers = stacked_layers(lambda r: self.make_layer(c, r, self.ctx), c.num_layers, rngs,
                                     self.ctx.layout.pipeline)
        self.init_head(c, rngs)

    def hidden(self, tokens, documents=None):
        x, positions, embed = self.embed_tokens(tokens, documents)
        x = run_layers(self.layers, x, positions, self.remat_segments, self.config.scan_layers, self.params_on_host,
                       layout=self.ctx.layout)
        return self.final_normed(x), embed, {}

    def __call__(self, tokens, documents=None):
        """tokens [batch, length] int32 -> logits [batch, length, vocab] float32 (documents: as losses takes them)."""
        x, embed, _ = self.hidden(tokens, documents)
        return self.unembed_normed(x, embed)

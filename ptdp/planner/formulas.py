"""The dissertation's closed-form formulas, torch-free so anything can import them cheaply.

Equation numbers are those of Narayanan's dissertation (chapter 4 is the PTD-P paper). The
trainer reports model TFLOP/s per rank from these formulas (`ptdp/metrics/throughput.py`), so the
conventions here are the paper's, not a hardware FLOP count:

* Eq. 4.2 counts 4 passes per transformer layer (forward, backward = 2x,
  and the extra forward of activation recomputation) whether or not recomputation is on.
  Pass `recompute_forward=False` for the 3-pass "model FLOPs" of a run without it.
* Eq. 4.3 counts parameters of a GPT with a tied output embedding.
* Eq. 4.4 estimates training time as 8*T*P / (n*X).

BERT is not a GPT: its loss runs a dense + GeLU + LayerNorm transform before the tied logits
(with a vocabulary bias), a pooler and a binary head, and it embeds token types
(models/bert.py). `bert_flops_per_iteration` and `bert_parameter_count` count those;
`model_flops` and `model_parameters` pick the formula by architecture.
"""

from __future__ import annotations

SECONDS_PER_DAY = 86_400.0


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                              recompute_forward: bool = True) -> float:
    """Eq. 4.2: F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)) floating-point operations.

    Derivation: a layer's forward pass costs 24Bsh^2 + 4Bs^2h; backward twice
    that; recomputation one more forward -> 4x. The logit layer costs 6BshV (fwd + bwd) and
    is never recomputed. With `recompute_forward=False` the layer factor is 3 instead of 4.
    """
    b, s, l, h, v = float(batch), float(seq), float(layers), float(hidden), float(vocab)
    passes = 4.0 if recompute_forward else 3.0
    per_layer_forward = 24.0 * b * s * h * h + 4.0 * b * s * s * h
    return passes * l * per_layer_forward + 6.0 * b * s * h * v


def parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Eq. 4.3: P = 12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h)).

    Per layer 12h^2 weights + 13h biases/LayerNorm parameters, plus word (V*h) and position
    (s*h) embeddings; the output layer shares the word embedding.
    """
    l, h, v, s = float(layers), float(hidden), float(vocab), float(seq)
    return 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (v + s) / (12.0 * l * h))


def bert_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                             recompute_forward: bool = True) -> float:
    """Eq. 4.2's encoder layers (bidirectional attention computes the same full s x s scores)
    plus BERT's heads, forward and backward (3 passes, never recomputed):

    * masked-LM head on every position (models/bert.py computes all logits and masks the
      loss): the dense h x h transform and the tied logits, 2Bs(h^2 + hV) forward;
    * pooler (h x h) and binary head (h x 2) on the [CLS] position, 2B(h^2 + 2h) forward.
    """
    b, s, h, v = float(batch), float(seq), float(hidden), float(vocab)
    encoder = model_flops_per_iteration(batch, seq, layers, hidden, vocab,
                                        recompute_forward) - 6.0 * b * s * h * v
    return encoder + 6.0 * b * s * (h * h + h * v) + 6.0 * b * (h * h + 2.0 * h)


def bert_parameter_count(layers: int, hidden: int, vocab: int, seq: int,
                         tokentypes: int = 2) -> float:
    """Parameters of models/bert.py: per layer 12h^2 + 13h, word (V h), position (s h) and
    token-type (tokentypes h) embeddings, the final LayerNorm (2h), the LM head's dense
    transform (h^2 + h), LayerNorm (2h) and vocabulary bias (V; the logits reuse the word
    table), the pooler (h^2 + h) and the binary head (2h + 2)."""
    l, h, v, s = float(layers), float(hidden), float(vocab), float(seq)
    encoder = l * (12.0 * h * h + 13.0 * h)
    embeddings = (v + s + tokentypes) * h
    heads = 2.0 * h + (h * h + h) + 2.0 * h + v + (h * h + h) + (2.0 * h + 2.0)
    return encoder + embeddings + heads


def model_flops(arch: str, batch: int, seq: int, layers: int, hidden: int, vocab: int,
                recompute_forward: bool = True) -> float:
    """Model FLOPs of one iteration for `arch` ('gpt': Eq. 4.2; 'bert': its own heads)."""
    formula = bert_flops_per_iteration if arch == "bert" else model_flops_per_iteration
    return formula(batch, seq, layers, hidden, vocab, recompute_forward)


def model_parameters(arch: str, layers: int, hidden: int, vocab: int, seq: int,
                     tokentypes: int = 2) -> float:
    """Parameters for `arch` ('gpt': Eq. 4.3; 'bert': bert_parameter_count)."""
    if arch == "bert":
        return bert_parameter_count(layers, hidden, vocab, seq, tokentypes)
    return parameter_count(layers, hidden, vocab, seq)


def training_days(tokens: float, parameters: float, num_gpus: int,
                  tflops_per_gpu: float) -> float:
    """Eq. 4.4: end-to-end training time ~ 8*T*P / (n*X), in days.

    `tflops_per_gpu` is X in teraFLOP/s per GPU as measured with Eq. 4.2. Example from the
    source: 175e9 parameters, 300e9 tokens, 1024 GPUs at 140 TFLOP/s -> ~34 days.
    """
    if num_gpus <= 0 or tflops_per_gpu <= 0:
        raise ValueError("num_gpus and tflops_per_gpu must be positive")
    seconds = 8.0 * tokens * parameters / (num_gpus * tflops_per_gpu * 1e12)
    return seconds / SECONDS_PER_DAY


def iterations_for_tokens(tokens: float, global_batch: int, seq: int) -> float:
    """I = T / (B*s)."""
    return tokens / (global_batch * seq)


def bubble_fraction(pipeline: int, micro_batches: int, chunks: int = 1) -> float:
    """Pipeline bubble of flushing schedules as a fraction of ideal time: (p-1)/(v*m).

    GPipe and 1F1B: (p-1)/m; interleaved 1F1B with v chunks per device:
    (1/v)*(p-1)/m. PipeDream-2BW and async PipeDream have no flush, hence no bubble.
    """
    if micro_batches <= 0 or chunks <= 0:
        raise ValueError("micro_batches and chunks must be positive")
    return (pipeline - 1) / (chunks * micro_batches)


def tensor_parallel_elements_per_layer(batch: int, seq: int, hidden: int, tensor: int) -> float:
    """Elements each device moves per layer per micro-batch: 8*b*s*h*(t-1)/t.

    Two all-reduces of b*s*h forward and two backward, each a ring moving 2(t-1)/t of it.
    """
    return 8.0 * batch * seq * hidden * (tensor - 1) / tensor


def pipeline_elements_per_boundary(batch: int, seq: int, hidden: int, tensor: int = 1,
                                   scatter_gather: bool = False) -> float:
    """Elements sent between consecutive stages per micro-batch, one direction: b*s*h,
    or b*s*h/t with the scatter/gather optimization."""
    elements = float(batch * seq * hidden)
    return elements / tensor if scatter_gather else elements


def eq41_batch_time(global_per_replica: int, micro_batch: int, pipeline: int,
                    t_forward: float, t_backward: float) -> float:
    """Eq. 4.1: (b'/b + p - 1) * (t_f(b) + t_b(b)) with b' = B/d; ignores comm."""
    return (global_per_replica / micro_batch + pipeline - 1) * (t_forward + t_backward)


def optimal_checkpoints(layers: int, a_intermediate: float, a_input: float) -> float:
    """c = sqrt(l * A_intermediate / A_input) minimises c*A_input + (l/c)*A_intermediate."""
    return (layers * a_intermediate / a_input) ** 0.5

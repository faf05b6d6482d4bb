"""Sampling by the exponential race (Gumbel-max) in one pass over the logits.

    token = argmax_v  logits[v] / T - log(E_v),   E_v = -log(U_v),  U_v ~ Uniform(0, 1)

picks v with probability softmax(logits / T)[v]: the same rule as the torch sampler's
`argmax(probs / E)`, without materializing probabilities or noise. U comes from Triton's
Philox generator keyed by a 63-bit seed per row and the vocabulary index (each Philox call
gives four uniforms, for four entries: drawing them is most of the kernel's work at B = 256),
so a row's token depends only on its seed. A row with T = 0 takes the plain argmax. Each program scans one
chunk of one row; a second, tiny step picks the best chunk.

The unfused sampler reads and writes [B, V] float32 tensors ~10 times (cast, scale, softmax,
noise, log, divide, argmax); at B = 256 and V = 152k that is ~2 GB per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # vocabulary entries per program


@triton.jit
def _race_window(best_val, best_idx, row_ptr, offs, u, inv_t, vocab_size, NOISE: tl.constexpr):
    """Folds the entries `offs` (with uniforms u) into each lane's best so far."""
    mask = offs < vocab_size
    val = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    if NOISE:
        # -log(E) with E = -log(U); U = 0 would give E = inf: a token that can never win.
        val += -tl.log(-tl.log(tl.maximum(u, 1e-20)))
    better = val > best_val  # strict: the first index wins a tie
    return tl.where(better, val, best_val), tl.where(better, offs.to(tl.int64), best_idx)


@triton.jit
def _race_kernel(
    logits_ptr,  # [B, V], any float dtype, row stride stride_row
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    best_val_ptr,  # [B, num_chunks] float32
    best_idx_ptr,  # [B, num_chunks] int64
    vocab_size,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    row_ptr = logits_ptr + row * stride_row
    # One Philox call gives four uniforms, one for each quarter of a BLOCK-entry window:
    # window w, lane i -> Philox counter w * BLOCK / 4 + i, entries w * BLOCK + j * Q + i.
    Q: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, Q)
    best_val = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.full([Q], 0, tl.int64)
    end = tl.minimum(chunk * CHUNK + CHUNK, vocab_size)
    if temperature == 0.0:  # argmax: no noise to draw
        for start in range(chunk * CHUNK, end, Q):
            best_val, best_idx = _race_window(
                best_val, best_idx, row_ptr, start + lanes, best_val, 1.0, vocab_size, False
            )
    else:
        inv_t = 1.0 / temperature
        for start in range(chunk * CHUNK, end, BLOCK):
            u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
            best_val, best_idx = _race_window(
                best_val, best_idx, row_ptr, start + lanes, u0, inv_t, vocab_size, True
            )
            best_val, best_idx = _race_window(
                best_val, best_idx, row_ptr, start + Q + lanes, u1, inv_t, vocab_size, True
            )
            best_val, best_idx = _race_window(
                best_val, best_idx, row_ptr, start + 2 * Q + lanes, u2, inv_t, vocab_size, True
            )
            best_val, best_idx = _race_window(
                best_val, best_idx, row_ptr, start + 3 * Q + lanes, u3, inv_t, vocab_size, True
            )
    value = tl.max(best_val, axis=0)
    # Ties across lanes: the smallest index among the lanes holding the maximum.
    index = tl.min(tl.where(best_val == value, best_idx, vocab_size), axis=0)
    tl.store(best_val_ptr + row * num_chunks + chunk, value)
    tl.store(best_idx_ptr + row * num_chunks + chunk, index)


def race_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token per row of logits [B, V] (last dim contiguous): the exponential race at
    temperature[b] (0 = argmax) with noise from seeds[b]. Returns [B] int64."""
    num_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("race_sample needs logits with a contiguous last dim")
    if temperature.shape != (num_rows,) or seeds.shape != (num_rows,):
        raise ValueError("temperature and seeds need one entry per row")
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_val = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    if num_rows:
        _race_kernel[(num_rows, num_chunks)](
            logits, temperature, seeds, best_val, best_idx, vocab, logits.stride(0),
            num_chunks, CHUNK=CHUNK, BLOCK=1024, num_warps=4,
        )
    # NOTE: argmax returns the first best chunk, so ties go to the smallest index overall.
    return best_idx.gather(1, best_val.argmax(1, keepdim=True))[:, 0]

"""Orders computed per index in O(1): the per-epoch window shuffle and the mixture schedule.

Window shuffle (prepared sets). Epoch e of a set with n windows visits window ``perm_e(i)`` at its
i-th position, where ``perm_e`` is a bijection of [0, n) built as a balanced Feistel network on
2h bits (h = ceil(bit_length(n - 1) / 2), at least 1) with 6 rounds, walked in cycles until the
value falls in [0, n) (format-preserving encryption by cycle walking: Black & Rogaway, "Ciphers
with Arbitrary Finite Domains", CT-RSA 2002; Luby & Rackoff 1988 for the Feistel construction).
A round maps (L, R) to (R, L xor (F(R xor k_j) mod 2^h)), F the splitmix64 finaliser (Steele et
al., "Fast splittable pseudorandom number generators", OOPSLA 2014), k_0..k_5 the first six
little-endian uint64 words of sha512("quadra-window-order:{seed}:{stream}:{epoch}"). Since 2^2h < 4n,
a value needs fewer than 4 rounds of walking on average. Nothing is stored: a rank computes the
windows it reads, at any position, without an O(n) permutation or a cached index.

Mixture schedule. Weights w_i become integer counts k_i per block of B = 10000 positions (largest
remainder, each >= 1, sum B). Slot j of every block goes to the source chosen by smooth weighted
round robin: each source's credit grows by k_i, the largest credit wins (lowest index on ties) and
loses B. Position p is slot p mod B of block p // B; it reads the source's own position
(p // B) * k_i + (earlier slots of source i in the block). The schedule repeats every B positions
exactly, so source i gets exactly k_i / B of every block, spread evenly.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
BLOCK = 10_000
SCALAR_BELOW = 64  # fewer indices than this: Python integers (numpy's per-call overhead dominates)
_FULL = (1 << 64) - 1
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class WindowPermutation:
    """The bijection ``perm_e`` of [0, n) described in the module docstring.

    Args:
        n: windows per epoch (>= 1).
        seed: training.seed; stream: the source's index in a mixture (0 for one set); epoch: e.
    """

    def __init__(self, n: int, *, seed: int, stream: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1 elements, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half) - 1)
        digest = hashlib.sha512(f"quadra-window-order:{seed}:{stream}:{epoch}".encode()).digest()
        self._int_keys = [int.from_bytes(digest[8 * j: 8 * j + 8], "little") for j in range(ROUNDS)]
        self.keys = [np.uint64(k) for k in self._int_keys]

    def _feistel_int(self, x: int) -> int:
        """``_feistel`` of one index with Python integers (the same function, bit for bit)."""
        half, mask = self.half, int(self._mask)
        left, right = x >> half, x & mask
        for key in self._int_keys:
            y = right ^ key
            y = ((y ^ (y >> 30)) * 0xBF58476D1CE4E5B9) & _FULL
            y = ((y ^ (y >> 27)) * 0x94D049BB133111EB) & _FULL
            left, right = right, left ^ ((y ^ (y >> 31)) & mask)
        return (left << half) | right

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self._mask
        with np.errstate(over="ignore"):
            for key in self.keys:
                left, right = right, left ^ (_splitmix(right ^ key) & self._mask)
        return (left << half) | right

    def __call__(self, index: np.ndarray | int) -> np.ndarray:
        """perm_e of each index (int64 array of the input's shape; indices must be in [0, n))."""
        if np.size(index) < SCALAR_BELOW:
            out = []
            for i in np.asarray(index, dtype=np.int64).reshape(-1).tolist():
                i = self._feistel_int(i)
                while i >= self.n:
                    i = self._feistel_int(i)
                out.append(i)
            return np.asarray(out, dtype=np.int64).reshape(np.shape(index))
        x = self._feistel(np.asarray(index, dtype=np.uint64).reshape(-1))
        out = x.copy()
        pending = np.nonzero(out >= self.n)[0]
        while len(pending):
            out[pending] = self._feistel(out[pending])
            pending = pending[out[pending] >= self.n]
        return out.astype(np.int64).reshape(np.shape(index))


def integer_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Counts k_i per block of ``block`` positions: largest remainder of w_i / sum(w) * block.

    Raises:
        ValueError: a weight so small that its count would be 0.
    """
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    if min(counts) < 1:
        raise ValueError(f"mixture weights {weights}: each must be at least 1/{block} of the total")
    return counts


class MixtureSchedule:
    """Which source each global position reads, and where in that source (O(1) per position).

    Args:
        weights: positive weights, one per source (normalised here).
        block: B, positions per repeat of the schedule.

    Attributes:
        counts: k_i, positions of source i per block.
    """

    def __init__(self, weights: list[float], block: int = BLOCK):
        self.block = block
        self.counts = integer_counts(weights, block)
        credit = [0] * len(self.counts)
        pattern = np.empty(block, np.int64)
        for j in range(block):
            for i, k in enumerate(self.counts):
                credit[i] += k
            best = max(range(len(credit)), key=lambda i: (credit[i], -i))
            credit[best] -= block
            pattern[j] = best
        self.pattern = pattern
        # before[i, j]: slots < j of source i within a block.
        onehot = pattern[None, :] == np.arange(len(self.counts))[:, None]
        self.before = np.concatenate([np.zeros((len(self.counts), 1), np.int64), np.cumsum(onehot, axis=1)], axis=1)
        self.rank_in_block = self.before[pattern, np.arange(block)]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, position within that source) of each global position (int64 arrays)."""
        positions = np.asarray(positions, dtype=np.int64)
        block, slot = np.divmod(positions, self.block)
        source = self.pattern[slot]
        return source, block * np.asarray(self.counts)[source] + self.rank_in_block[slot]

    def count_before(self, position: int) -> list[int]:
        """Positions of each source among the global positions [0, position)."""
        block, slot = divmod(int(position), self.block)
        return [block * k + int(self.before[i, slot]) for i, k in enumerate(self.counts)]


def sequence_permutation(n: int, seed: int) -> list[int]:
    """A fixed reordering of a microbatch's ``n`` sequences (``data.sequence_order_seed``), never the
    identity when ``n`` >= 2: the window shuffle's bijection of [0, n) (:class:`WindowPermutation`,
    stream -1, so no data set's order, epoch 0), rotated by one when that is the identity.

    Every loss term (token-sum cross entropy, z-loss, MoE balance over tokens or per sequence) is a
    sum over sequences, so the step is the same in exact arithmetic; only the order of the float sums
    over the batch changes (a weight gradient sums over tokens). Used for the noise floor of
    engine/parity/noise.py.

    Raises:
        ValueError: ``n`` < 1 or ``seed`` < 1.
    """
    if n < 1 or seed < 1:
        raise ValueError(f"sequence_permutation needs n >= 1 and seed >= 1, got n={n}, seed={seed}")
    order = WindowPermutation(n, seed=seed, stream=-1, epoch=0)(np.arange(n, dtype=np.int64)).tolist()
    if order == list(range(n)):
        order = order[1:] + order[:1]
    return order

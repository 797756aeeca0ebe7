"""`kfac.describe`'s result: a dict of each params leaf's description that prints as a
table."""

from __future__ import annotations

__all__ = ["Description"]


class Description(dict[str, str]):
    """Each params leaf's path -> what K-FAC's capture makes of it (`kfac.describe`).

    A dict; ``str()`` (``print``) gives an aligned two-column table, one leaf a line, and
    a last line counting the preconditioned kernels, the skipped ones and the leaves left
    to a first-order update.

    Example:
      >>> print(Description({"l/kernel": "dense, d_in 4, d_out 2, with bias l/bias",
      ...                    "l/bias": "bias of l/kernel", "s": "first-order: read by mul"}))
      leaf      K-FAC
      l/kernel  dense, d_in 4, d_out 2, with bias l/bias
      l/bias    bias of l/kernel
      s         first-order: read by mul
      1 kernel preconditioned, 0 skipped, 2 other leaves (biases go with their kernel)
    """

    def __str__(self) -> str:
        width = max([len("leaf"), *map(len, self)])
        lines = [f"{'leaf':<{width}}  K-FAC"]
        lines += [f"{path:<{width}}  {what}" for path, what in self.items()]
        skipped = sum(what.startswith("skipped:") for what in self.values())
        kernels = sum(not what.startswith(("skipped:", "bias of ", "first-order", "unused"))
                      for what in self.values())
        others = len(self) - kernels - skipped
        plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"
        lines.append(f"{plural(kernels, 'kernel')} preconditioned, {skipped} skipped, "
                     f"{plural(others, 'other leaf').replace('leafs', 'leaves')} (biases go "
                     "with their kernel)")
        return "\n".join(lines)

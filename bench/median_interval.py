#!/usr/bin/env python3
"""A distribution-free confidence interval for the median of a sample.

Usage: median_interval.py X1 X2 ... Xn   prints "lo hi coverage-percent".

The interval is the k-th smallest and the k-th largest of the n values, with k the largest for
which Binomial(n, 1/2) puts at most 5% of its mass below k, so it covers the true median with
at least 90% probability whatever the distribution (order statistics; no normality assumed).
With fewer than 5 values no such k exists: the interval is then the whole range, and the
coverage printed says how little that is.
"""
import math
import sys


def median_interval(values):
    r = sorted(values)
    n = len(r)
    if n == 0:
        raise ValueError("no values")

    def below(k):  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max([1] + [k for k in range(1, n // 2 + 1) if below(k) <= 0.05])
    return r[k - 1], r[n - k], 100 * (1 - 2 * below(k))


if __name__ == "__main__":
    try:
        values = [float(x) for x in sys.argv[1:]]
        lo, hi, cover = median_interval(values)
    except ValueError as e:
        sys.exit("median_interval.py: expected one or more numbers, got %r (%s)" % (sys.argv[1:], e))
    print("%.3f %.3f %.1f" % (lo, hi, cover))

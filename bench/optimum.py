"""The optimum of a loss-vs-lr curve on a log grid: the vertex of the parabola in log2(lr)
through its best point and that point's neighbours (bench/lr_sweep.py's reported optima)."""

from __future__ import annotations

import math


def means(points: list[tuple[float, float | None, list]]) -> list[tuple[float, float, list]]:
    """The points every seed finished."""
    return [p for p in points if p[1] is not None]


def vertex(points: list[tuple[float, float, list]]) -> float:
    """The lr at the minimum of the parabola in log2(lr) through the best grid point and its two
    neighbours among `points` (the best point itself where it is at an edge or the parabola opens
    downwards). The neighbours may be more than one grid step away: a seed's span may skip a k."""
    i = min(range(len(points)), key=lambda j: points[j][1])
    if i in (0, len(points) - 1):
        return points[i][0]
    (x0, y0), (x1, y1), (x2, y2) = ((math.log2(p[0]), p[1]) for p in points[i - 1:i + 2])
    slope_left, slope_right = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    curvature = (slope_right - slope_left) / (x2 - x0)  # the parabola's x^2 coefficient
    if curvature <= 0:
        return points[i][0]
    return 2 ** ((x0 + x1) / 2 - slope_left / (2 * curvature))


def parabola(points: list[tuple[float, float]], x: float) -> float:
    """The value at x of the parabola through three (x, y) points (Lagrange's form)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    return (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
            + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))

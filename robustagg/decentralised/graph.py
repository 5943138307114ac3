"""Communication graphs of decentralised learning: topologies, mixing weights, Byzantine placement.

A :class:`Graph` is an undirected simple graph on nodes ``0 .. N-1`` (no self-loops; a node always
mixes with itself through its own weight ``W_ii``). Its neighbourhoods are what each node receives
from per round; :func:`mixing_matrix` gives the gossip weights ``W`` ``(N, N)`` float64 and
:func:`honest_subgraph` what the honest nodes can rely on (its connectivity and spectral gap).

The constructors build on NetworkX (Hagberg, Schult, Swart, SciPy 2008)::

    >>> from robustagg.decentralised import graph
    >>> g = graph.ring(6)
    >>> g.neighbours(0), g.degree(0)
    ((1, 5), 2)
    >>> graph.mixing_matrix(g, "metropolis")[0].round(4).tolist()
    [0.3333, 0.3333, 0.0, 0.0, 0.0, 0.3333]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import networkx as nx  # type: ignore[import-untyped]
import numpy as np

from ..errors import ConfigError

__all__ = ["Graph", "ring", "torus", "complete", "erdos_renyi", "exponential", "dumbbell", "from_edges",
           "from_file", "build", "TOPOLOGIES", "mixing_matrix", "WEIGHTINGS", "place_byzantine", "PLACEMENTS",
           "honest_subgraph", "spectral_gap"]


@dataclass(frozen=True)
class Graph:
    """An undirected simple graph on ``N`` nodes (``0 .. N-1``).

    Attributes:
        name: how it was built (``"ring(8)"``), for records and messages.
        adjacency: ``(N, N)`` bool numpy array, symmetric, all-false diagonal.

    Raises:
        ConfigError: an adjacency that is not square, not symmetric, has a self-loop, or has
            fewer than 2 nodes (at construction).
    """

    name: str
    adjacency: np.ndarray

    def __post_init__(self) -> None:
        a = np.asarray(self.adjacency, dtype=bool)
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            raise ConfigError(f"graph {self.name}: the adjacency must be a square (N, N) matrix; got shape {a.shape}.")
        if a.shape[0] < 2:
            raise ConfigError(f"graph {self.name}: needs at least 2 nodes; got {a.shape[0]}.")
        if a.diagonal().any():
            raise ConfigError(f"graph {self.name}: self-loops at nodes {np.flatnonzero(a.diagonal()).tolist()}; a node "
                              "mixes with itself through its own weight, so leave the diagonal empty.")
        if not (a == a.T).all():
            i, j = map(int, np.argwhere(a != a.T)[0])
            raise ConfigError(f"graph {self.name}: the adjacency is not symmetric (edge {i}-{j} one way only); "
                              "decentralised gossip here is undirected.")
        object.__setattr__(self, "adjacency", a)

    @property
    def num_nodes(self) -> int:
        """``N``."""
        return int(self.adjacency.shape[0])

    def neighbours(self, i: int) -> tuple[int, ...]:
        """The nodes node ``i`` receives from (ascending, without ``i``)."""
        return tuple(int(j) for j in np.flatnonzero(self.adjacency[i]))

    def degree(self, i: int) -> int:
        """The number of neighbours of node ``i``."""
        return int(self.adjacency[i].sum())

    def edges(self) -> list[tuple[int, int]]:
        """Every edge once, ``(i, j)`` with ``i < j``, ascending."""
        return [(int(i), int(j)) for i, j in zip(*np.nonzero(np.triu(self.adjacency)))]

    def to_networkx(self) -> nx.Graph:
        """The graph as a :class:`networkx.Graph` (every node present, isolated ones too)."""
        g = nx.Graph()
        g.add_nodes_from(range(self.num_nodes))
        g.add_edges_from(self.edges())
        return g


def _from_networkx(name: str, g: nx.Graph, n: int) -> Graph:
    a = np.zeros((n, n), dtype=bool)
    index = {v: k for k, v in enumerate(sorted(g.nodes()))}
    for u, v in g.edges():
        if u != v:
            a[index[u], index[v]] = a[index[v], index[u]] = True
    return Graph(name, a)


def _count(n: object, topology: str = "a graph", least: int = 2) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) < least:
        raise ConfigError(f"{topology} needs an integer number of nodes >= {least} (threat.n, one node per worker); "
                          f"got {n!r}.")
    return int(n)


def ring(n: int) -> Graph:
    """The cycle ``0 - 1 - ... - (N-1) - 0`` (every degree 2; ``N = 2``: one edge).

    Raises:
        ConfigError: ``n < 2``.
    """
    n = _count(n, "a ring")
    return _from_networkx(f"ring({n})", nx.cycle_graph(n), n)


def torus(n: int, rows: int = 0) -> Graph:
    """The 2-D torus: a ``rows x (N / rows)`` grid with wrap-around edges (degree 4 when both sides
    are at least 3). ``rows = 0`` picks the divisor of ``N`` nearest to ``sqrt(N)``.

    Raises:
        ConfigError: ``rows`` does not divide ``n``, or a side shorter than 2.
    """
    n = _count(n, "a torus", least=4)
    if rows == 0:
        rows = min((r for r in range(2, n) if n % r == 0), key=lambda r: (abs(r - math.sqrt(n)), r), default=0)
    if rows == 0:
        raise ConfigError(f"a torus of {n} nodes needs n = rows x columns with both sides at least 2, and {n} has no "
                          "such divisor: pick a composite threat.n (e.g. 16) or another topology.")
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 2 or n % int(rows) or n // rows < 2:
        raise ConfigError(f"protocol.torus_rows must divide the number of nodes {n} into two sides of at least 2; "
                          f"got {rows!r}. Pick a composite number of nodes or another torus_rows.")
    rows = int(rows)
    g = nx.grid_2d_graph(rows, n // rows, periodic=True)
    g = nx.relabel_nodes(g, {(r, c): r * (n // rows) + c for r, c in g.nodes()})
    return _from_networkx(f"torus({rows}x{n // rows})", g, n)


def complete(n: int) -> Graph:
    """Every pair of nodes connected (degree ``N - 1``).

    Raises:
        ConfigError: ``n < 2``.
    """
    n = _count(n)
    return _from_networkx(f"complete({n})", nx.complete_graph(n), n)


def erdos_renyi(n: int, p: float, seed: int) -> Graph:
    """Erdős–Rényi ``G(N, p)``: each of the ``N (N-1) / 2`` edges present independently with
    probability ``p``, drawn from ``seed`` (NetworkX's ``gnp_random_graph``). It may be disconnected:
    :func:`honest_subgraph` checks what the honest nodes get.

    Raises:
        ConfigError: ``p`` outside ``(0, 1]``.
    """
    n = _count(n)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < float(p) <= 1.0:
        raise ConfigError(f"protocol.edge_probability must be in (0, 1]; got {p!r}.")
    return _from_networkx(f"erdos_renyi({n}, p={float(p):g}, seed={int(seed)})",
                          nx.gnp_random_graph(n, float(p), seed=int(seed)), n)


def exponential(n: int) -> Graph:
    """The (undirected) exponential graph: node ``i`` is joined to ``i ± 2^k mod N`` for
    ``k = 0, 1, ..., floor(log2(N - 1))`` (Assran et al., ICML 2019; Ying et al., NeurIPS 2021).

    Raises:
        ConfigError: ``n < 2``.
    """
    n = _count(n)
    a = np.zeros((n, n), dtype=bool)
    hop = 1
    while hop < n:
        for i in range(n):
            for j in ((i + hop) % n, (i - hop) % n):
                if j != i:
                    a[i, j] = a[j, i] = True
        hop *= 2
    return Graph(f"exponential({n})", a)


def dumbbell(n: int) -> Graph:
    """Two cliques of ``N / 2`` nodes (``0 .. N/2-1`` and the rest) joined by one bridge edge
    ``(N/2 - 1) - (N/2)``: the information bottleneck of He, Karimireddy, Jaggi (2022), Fig. 1.

    Raises:
        ConfigError: ``n`` odd or below 4.
    """
    n = _count(n, "a dumbbell", least=4)
    if n % 2:
        raise ConfigError(f"a dumbbell joins two equal cliques: the number of nodes must be even; got {n}.")
    h = n // 2
    a = np.zeros((n, n), dtype=bool)
    a[:h, :h] = True
    a[h:, h:] = True
    np.fill_diagonal(a, False)
    a[h - 1, h] = a[h, h - 1] = True
    return Graph(f"dumbbell({n})", a)


def from_edges(n: int, edges: Any, name: str = "edges", where: str = "protocol.edges") -> Graph:
    """A user-given graph: ``n`` nodes and a list of undirected edges ``[i, j]`` (a repeated edge
    counts once).

    Args:
        where: what to name in messages (the config key, or the file the edges came from).

    Raises:
        ConfigError: ``edges`` is not a non-empty list of pairs of distinct node ids in ``[0, n)``.
    """
    n = _count(n)
    if isinstance(edges, (str, bytes, dict)) or not isinstance(edges, Iterable):
        raise ConfigError(f"{where}: expected a list of edges [[i, j], ...]; got {edges!r}.")
    a = np.zeros((n, n), dtype=bool)
    count = 0
    for e in edges:
        pair = list(e) if isinstance(e, (list, tuple)) else None
        if pair is None or len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                                 for v in pair):
            raise ConfigError(f"{where}: every edge is a pair of integer node ids [i, j]; got {e!r}.")
        i, j = (int(v) for v in pair)
        if not (0 <= i < n and 0 <= j < n) or i == j:
            raise ConfigError(f"{where}: edge {[i, j]} must join two distinct nodes of 0..{n - 1} (threat.n={n}).")
        a[i, j] = a[j, i] = True
        count += 1
    if count == 0:
        raise ConfigError(f"{where} holds no edge: give at least one [i, j] pair.")
    return Graph(name, a)


def from_file(path: str | Path, n: int) -> Graph:
    """A user-given graph from a file: JSON (a list of edges ``[[i, j], ...]``, or an ``N x N`` 0/1
    matrix: a square list of 0s and 1s of more than 2 rows is read as a matrix, a 2 x 2 one only
    when ``n = 2``), or text (one edge ``i j`` per line, ``#`` comments).

    Raises:
        ConfigError: the file is missing or unreadable, its matrix is not ``n x n`` (or not
            symmetric, or has a self-loop), it holds no edge, or an edge is invalid
            (:func:`from_edges`); the message names the file.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"protocol.adjacency_file {str(p)!r} cannot be read ({e}); give a JSON edge list or "
                          "matrix, or a text file of 'i j' lines.") from None
    name = f"file({p.name})"
    where = f"protocol.adjacency_file {str(p)!r}"
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e}).") from None
        if not isinstance(data, list):
            raise ConfigError(f"{where}: expected a list of edges [[i, j], ...] or an {n} x {n} 0/1 matrix.")
        square = len(data) > 0 and all(isinstance(r, list) and len(r) == len(data) for r in data)
        zero_one = square and all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1)
                                  for r in data for v in r)
        if square and zero_one and (len(data) > 2 or n == 2):  # an n x n 0/1 list is a matrix (2 x 2 only at n = 2)
            if len(data) != n:
                raise ConfigError(f"{where}: a {len(data)} x {len(data)} adjacency matrix, but threat.n={n}: it must "
                                  f"be {n} x {n}.")
            m = np.asarray(data, dtype=np.int64)
            try:
                return Graph(name, m.astype(bool))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        return from_edges(n, data, name=name, where=where)
    edges = []
    for k, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            edges.append([int(v) for v in parts])
        except ValueError:
            raise ConfigError(f"{where} line {k}: expected two node ids, got {line!r}.") from None
    return from_edges(n, edges, name=name, where=where)


#: ``protocol.topology`` names and what they build (:func:`build`).
TOPOLOGIES = ("ring", "torus", "complete", "erdos_renyi", "exponential", "dumbbell", "edges", "file")


def build(topology: str, n: int, *, seed: int = 0, edge_probability: float = 0.5, torus_rows: int = 0,
          edges: Any = None, adjacency_file: Any = None) -> Graph:
    """The graph ``protocol.topology`` names on ``n`` nodes (one entry point for the apps).

    Raises:
        ConfigError: an unknown topology (naming the known ones) or a bad parameter of it.
    """
    if topology == "ring":
        return ring(n)
    if topology == "torus":
        return torus(n, torus_rows)
    if topology == "complete":
        return complete(n)
    if topology == "erdos_renyi":
        return erdos_renyi(n, edge_probability, seed)
    if topology == "exponential":
        return exponential(n)
    if topology == "dumbbell":
        return dumbbell(n)
    if topology == "edges":
        if edges is None:
            raise ConfigError("protocol.topology=edges needs protocol.edges=[[i, j], ...].")
        return from_edges(n, edges)
    if topology == "file":
        if not adjacency_file:
            raise ConfigError("protocol.topology=file needs protocol.adjacency_file=<path>.")
        return from_file(adjacency_file, n)
    raise ConfigError(f"unknown protocol.topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}.")


#: ``protocol.weights`` names (:func:`mixing_matrix`).
WEIGHTINGS = ("metropolis", "uniform")


def mixing_matrix(graph: Graph, weighting: str = "metropolis", nodes: Sequence[int] | None = None) -> np.ndarray:
    """The gossip weights ``W`` ``(N, N)`` float64 (row ``i``: what node ``i`` gives itself and
    each neighbour); zero off the edges.

    - ``"metropolis"`` (Metropolis–Hastings; Xiao, Boyd, Kim 2007): ``W_ij = 1 / (1 + max(deg_i,
      deg_j))`` on an edge, ``W_ii = 1 - sum_j W_ij``. Symmetric and doubly stochastic, so plain
      gossip keeps the average.
    - ``"uniform"``: ``W_ij = 1 / (deg_i + 1)`` for ``j`` in ``{i} ∪ N(i)``. Row-stochastic only
      (symmetric on a regular graph): on an irregular graph gossip drifts to a degree-weighted mean.

    ``nodes`` restricts the graph to those nodes first (the degrees are counted inside it), for the
    honest subgraph's matrix; the result is then ``(len(nodes), len(nodes))`` in that order.

    Raises:
        ConfigError: an unknown ``weighting``.
    """
    a = graph.adjacency if nodes is None else graph.adjacency[np.ix_(list(nodes), list(nodes))]
    deg = a.sum(axis=1).astype(np.float64)
    if weighting == "metropolis":
        w = np.where(a, 1.0 / (1.0 + np.maximum(deg[:, None], deg[None, :])), 0.0)
    elif weighting == "uniform":
        w = np.where(a, 1.0 / (deg[:, None] + 1.0), 0.0)
    else:
        raise ConfigError(f"unknown protocol.weights {weighting!r}; choose one of {', '.join(WEIGHTINGS)}.")
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


#: ``protocol.placement`` names (:func:`place_byzantine`).
PLACEMENTS = ("random", "max_degree", "cut")


def place_byzantine(graph: Graph, f: int, placement: str = "random", seed: int = 0) -> tuple[int, ...]:
    """Which ``f`` nodes are Byzantine (ascending).

    - ``"random"``: ``f`` nodes drawn without replacement from ``seed``;
    - ``"max_degree"``: the ``f`` best-connected nodes (ties: the lower id first);
    - ``"cut"``: the nodes on the graph's bottleneck: the graph is split in two by the sign of its
      Fiedler vector (the Laplacian's second eigenvector), and the ``f`` nodes with the most edges
      across that cut are chosen (ties: the lower id). On :func:`dumbbell` they are the bridge's
      ends, the dissensus attack's best position (He, Karimireddy, Jaggi 2022, Sec. 4).

    Raises:
        ConfigError: ``f`` outside ``[0, N - 1]`` or an unknown ``placement``.
    """
    n = graph.num_nodes
    if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or not 0 <= int(f) < n:
        raise ConfigError(f"the number of Byzantine nodes must be in [0, {n - 1}] for {graph.name}; got {f!r}.")
    f = int(f)
    if f == 0:
        return ()
    if placement == "random":
        rng = np.random.default_rng(int(seed))
        return tuple(sorted(int(v) for v in rng.choice(n, size=f, replace=False)))
    deg = graph.adjacency.sum(axis=1)
    if placement == "max_degree":
        return tuple(sorted(sorted(range(n), key=lambda i: (-int(deg[i]), i))[:f]))
    if placement == "cut":
        lap = np.diag(deg.astype(np.float64)) - graph.adjacency.astype(np.float64)
        _, vecs = np.linalg.eigh(lap)
        fiedler = vecs[:, 1]
        side = fiedler >= 0
        crossing = (graph.adjacency & (side[:, None] != side[None, :])).sum(axis=1)
        return tuple(sorted(sorted(range(n), key=lambda i: (-int(crossing[i]), i))[:f]))
    raise ConfigError(f"unknown protocol.placement {placement!r}; choose one of {', '.join(PLACEMENTS)}.")


def spectral_gap(w: np.ndarray) -> float:
    """``1 - |lambda_2|`` of a mixing matrix ``(m, m)``, with ``|lambda_2|`` its second-largest
    eigenvalue modulus: how fast plain gossip contracts disagreement per round (0: never, e.g. a
    disconnected graph). A single node has gap 1. (Uniform weights give a row-stochastic matrix
    similar to a symmetric one, so its eigenvalues are real too.)"""
    m = np.asarray(w, dtype=np.float64)
    if m.shape[0] < 2:
        return 1.0
    values = np.linalg.eigvalsh(m) if np.allclose(m, m.T) else np.linalg.eigvals(m)
    lam = np.sort(np.abs(values))[::-1]
    return float(max(0.0, 1.0 - lam[1]))


def honest_subgraph(graph: Graph, byzantine: Sequence[int], weighting: str = "metropolis") -> dict[str, Any]:
    """What the honest nodes can rely on: the subgraph they induce among themselves.

    Returns:
        ``{"honest": [ids], "connected": bool, "components": [[ids], ...], "spectral_gap": float}``
        (the gap of :func:`mixing_matrix` on the honest subgraph, 0.0 when it is disconnected).
    """
    bad = set(int(b) for b in byzantine)
    honest = [i for i in range(graph.num_nodes) if i not in bad]
    sub = graph.to_networkx().subgraph(honest)
    comps = sorted(sorted(int(v) for v in c) for c in nx.connected_components(sub))
    connected = len(comps) == 1
    gap = spectral_gap(mixing_matrix(graph, weighting, nodes=honest)) if connected else 0.0
    return {"honest": honest, "connected": connected, "components": comps, "spectral_gap": gap}

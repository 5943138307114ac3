"""Decentralised learning on a graph: no server, one model per node (issue 30).

- :mod:`~robustagg.decentralised.graph`: topologies (ring, torus, complete, Erdős–Rényi,
  exponential, dumbbell, your own edges or file), gossip weights (Metropolis–Hastings, uniform),
  Byzantine placement (random, max_degree, cut) and the honest subgraph's spectral gap;
- :mod:`~robustagg.decentralised.rules`: the node-side rules (plain gossip, self-centred clipping,
  ClippedGossip, BRIDGE-T and BRIDGE-M, NNA, IOS, and any server rule on a neighbourhood);
- :mod:`~robustagg.decentralised.exposure`: every honest node's requirement at its degree, checked
  before launch;
- :mod:`~robustagg.decentralised.gossip`: one mixing round on stacked node models and the honest
  consensus distance.

The trainer's protocol is :class:`robustagg.protocols.Gossip` (``protocol=gossip``); the attacks of
this setting are in :mod:`attacks.gossip`. Guarantees and measured tables: ``docs/decentralised.md``.
"""

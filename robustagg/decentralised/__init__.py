"""Decentralised learning on a graph (no server): topologies, node-side rules, attacks, exposure."""

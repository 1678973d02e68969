"""VanishingExplodingDetector: exploding and vanishing gradients, judged from per-layer norms.

Its modules: the house table of docs/architecture.md.
"""

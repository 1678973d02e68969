"""GradientNormLogger: gradient and weight norms, update ratios, histograms, clipping and the noise scale.

Its modules: the house table of docs/architecture.md.
"""

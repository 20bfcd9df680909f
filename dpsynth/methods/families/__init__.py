"""Method families: the skeletons several methods share (diffusion, mean-embedding, GAN, classifier), one home each.

A method module in :mod:`dpsynth.methods` imports its family and states only what differs.
"""

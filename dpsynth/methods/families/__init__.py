"""Method families: the training recipes that several methods share (GAN, classifier), one home each.

A method module in :mod:`dpsynth.methods` imports its family and states only what differs.
"""

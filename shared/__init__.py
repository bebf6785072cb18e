"""The thin shared layer every variant uses: kernels, data, checkpoints, metrics, FLOPs.

Only what is truly general lives here. Model code lives in each variant's own folder.
"""

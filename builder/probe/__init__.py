"""Standard-library scripts run inside a target interpreter (any Python 3.9+, not cudaenv's):
each prints facts as JSON and imports nothing of cudaenv but ``builder.store`` from its own
directory. Run by path, never imported by cudaenv.
"""

"""Scheduling and KV block accounting: pure Python, never imports torch.

Everything here can be tested with a fake model in milliseconds. The model runner only
sees the plain records in :mod:`inflight.core.interface`.
"""

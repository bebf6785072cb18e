"""The thin shared layer every variant uses. Its module map is AGENTS.md's ("Map"), the only one.

Only what is truly general lives here. Model code lives in each variant's own folder.
"""

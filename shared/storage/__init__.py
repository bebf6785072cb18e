"""Bytes at rest, wherever they live: `objstore` (local paths, gs://, s3://, retries), `checkpoint`
(atomic saves and restores onto any mesh) and `tokenstore` (pre-tokenized corpora). Below the data and the
run; imports nothing of shared/ but `errors`. AGENTS.md's map says what each module does."""

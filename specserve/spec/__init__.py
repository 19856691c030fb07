"""Speculative decoding: drafting (`proposer`), verification and the tree's KV move
(`verify`), the choice of K (`policy`) and work queued ahead of the host (`overlap`)."""

"""Requests split across servers: the prefill/decode router and the Disaggregation service."""

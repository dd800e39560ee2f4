"""The decoding core: sampling and verification maths (`sampling`, `tree`, `verify`), the maps from the draft's
tokens to the target's (`mapping`), proposers (`propose`), the measured policies (`policy`; for requests served
together, `rows` over `stepcosts` and `measures`), the loop (`loop`), and the one place that builds a
generation's or a vLLM request's drafting state from them (`assemble`)."""

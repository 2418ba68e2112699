"""`aaflow bench NAME`: the benchmarks, against vLLM at its best where a peer exists; each writes
JSON (and a plot where one reads better). Layer: front end."""

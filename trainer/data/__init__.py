"""Training data: documents read offline (text_sources), the tokenizer (tokenizer), Hub folders
read offline (hub_layout), and the packed token stream each rank trains on (loader)."""

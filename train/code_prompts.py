"""Prompts of code that uses libraries from outside the standard library: the model card's quality
figures (train.evaluate) and the benchmarks (bench.engine, bench.policy, through bench/prompts.py)."""

# Each prompt ends at the end of a line, without the newline: the shipped tokenizer merges a
# newline with the next line's indentation ("\n   " then " return"), so a prompt ending in a bare
# "\n" sits at a token boundary that training text never has there, and the model reads it as
# the end of the block (it then starts a new function or ends the file).
CODE_PROMPTS = [
    "import numpy as np\n\n\ndef moving_average(x, window):\n    \"\"\"Mean of each window of x.\"\"\"",
    "from flask import Flask, jsonify, request\n\napp = Flask(__name__)\n\n\n@app.route('/users/<int:user_id>')\ndef get_user(user_id):",
    "import torch\nimport torch.nn as nn\n\n\nclass MLP(nn.Module):\n    def __init__(self, dim, hidden):\n        super().__init__()",
    "import requests\n\n\ndef fetch_json(url, retries=3, timeout=5.0):\n    for attempt in range(retries):",
    "import pandas as pd\n\n\ndef load_sales(path):\n    \"\"\"Read the sales CSV and return totals per region.\"\"\"\n    df = pd.read_csv(path)",
]

"""Reading the data a page of attnkit's HTML head view carries."""

from __future__ import annotations

import json
import re


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))

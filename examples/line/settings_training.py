SETTINGS = {"experiment": "line_study:Line", "data": {"train": 2000, "validation": 500}}

SETTINGS = {"analysis": "nre_analysis:NREAnalysis"}

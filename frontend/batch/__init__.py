"""`engine run-batch`: OpenAI batch files answered offline through the API server's own app."""

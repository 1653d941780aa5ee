"""Running the attacks' seeds as tasks: the task list and its scheduling, the local process pool, the Ray backend and the recipe a worker rebuilds its context from."""

"""How a run's processes talk: the frame format (`wire`), same-host shared-memory rings (`shm`),
trainer-to-trainer channels, the typed messages of a run and a trainer's step reports."""

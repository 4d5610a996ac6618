"""The trainer process: one trainer of one type runs its sub-program over pipelined micro-batches
(`process`), with its step book, mail, parameter-server access and background PS thread."""

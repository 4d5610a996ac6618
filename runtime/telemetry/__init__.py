"""What a run tells its user while and after it trains: metrics lines, a progress bar, a timeline
(`outputs`), and curves of a metrics file (`plot`)."""

"""PaddlePaddle import: a static program (legacy ProgramDesc `read` or PIR `pir`) reduced to what
`from_paddle` (`importer`) converts with one converter per Paddle op (`ops`)."""

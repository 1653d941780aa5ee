"""The audit's runtime context: the encoder, the data split, the noise and the seeds every stage and
attack reads (AuditContext), and how it is built from the options. Above the inputs it is built from,
below the attacks and stages that read it."""

//! The per-scope gates and the mark store under them: ordering, group commit, and what
//! survives a crash or damage.

mod gate;
mod group_commit;
mod integrity;

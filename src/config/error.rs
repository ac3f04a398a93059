//! Configuration errors and the accumulator that collects them. A leaf: it imports nothing
//! from the crate, so every section's module can use it without an import cycle.

use std::fmt;

/// One configuration error and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// All the errors of one configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A place in the list of errors, kept by the parse step for the errors of a file it names
/// but does not read: the load step reports them there, so an operator reads every error
/// in the order of the file, whichever step found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Place(u32);

/// Collects errors as validation walks the file, and then its files.
#[derive(Debug, Default)]
pub struct Errors {
    list: Vec<(Place, ConfigError)>,
    next: u32,
}

impl Errors {
    /// An error here, after every one so far.
    pub fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        let at = self.place();
        self.push_at(at, path, message);
    }

    /// Keeps a place here, after every error so far, for errors found later.
    pub fn place(&mut self) -> Place {
        let at = Place(self.next);
        self.next += 1;
        at
    }

    /// An error at a place kept before (after any others already there).
    pub fn push_at(&mut self, at: Place, path: impl Into<String>, message: impl Into<String>) {
        self.list.push((
            at,
            ConfigError {
                path: path.into(),
                message: message.into(),
            },
        ));
    }

    /// Errors at a place kept before, in their order.
    pub fn extend_at(&mut self, at: Place, errors: impl IntoIterator<Item = ConfigError>) {
        self.list.extend(errors.into_iter().map(|e| (at, e)));
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// How many errors so far.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// `value`, or every error in the order of the places they were reported at.
    pub fn finish<T>(mut self, value: impl FnOnce() -> Option<T>) -> Result<T, ConfigErrors> {
        if self.list.is_empty()
            && let Some(v) = value()
        {
            return Ok(v);
        }
        // Stable: errors at one place keep the order they were found in.
        self.list.sort_by_key(|(at, _)| *at);
        Err(ConfigErrors(
            self.list.into_iter().map(|(_, e)| e).collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_found_later_are_reported_at_the_place_kept_for_them() {
        let mut errors = Errors::default();
        errors.push("a", "first");
        let later = errors.place();
        errors.push("c", "third");
        errors.push_at(later, "b", "second");
        errors.extend_at(
            later,
            [ConfigError {
                path: "b2".into(),
                message: "second, too".into(),
            }],
        );
        let paths: Vec<String> = errors
            .finish(|| Some(()))
            .unwrap_err()
            .0
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(paths, ["a", "b", "b2", "c"]);
        assert_eq!(Errors::default().finish(|| Some(7)), Ok(7));
    }
}

//! Fencing tokens (SPEC §1): `counter` or `epoch:counter`, compared as (epoch, counter).
//!
//! The parser is strict on purpose: a token that could be spelled two ways could be
//! compared two ways, so leading zeros, signs, spaces and overflow are all malformed.

use std::fmt;

/// A fencing token. Field order matters: the derived `Ord` compares the epoch first,
/// so an epoch bump (after a restore) outranks every counter of earlier epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token {
    pub epoch: u64,
    pub counter: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("empty token")]
    Empty,
    #[error("a token part must be 1 to 20 ASCII digits")]
    NotDigits,
    #[error("a token part has a leading zero")]
    LeadingZero,
    #[error("a token part exceeds 2^64-1")]
    Overflow,
    #[error("a token has at most one ':'")]
    TooManyParts,
}

impl Token {
    pub const fn new(epoch: u64, counter: u64) -> Token {
        Token { epoch, counter }
    }

    /// Parses a header value. Bytes, not `&str`: header values need not be UTF-8.
    pub fn parse(raw: &[u8]) -> Result<Token, TokenError> {
        if raw.is_empty() {
            return Err(TokenError::Empty);
        }
        let mut parts = raw.splitn(3, |b| *b == b':');
        let first = parts.next().unwrap_or_default();
        match (parts.next(), parts.next()) {
            (None, _) => Ok(Token::new(0, parse_part(first)?)),
            (Some(second), None) => Ok(Token::new(parse_part(first)?, parse_part(second)?)),
            (Some(_), Some(_)) => Err(TokenError::TooManyParts),
        }
    }
}

/// Parses a `Fencing-Sequence` value (SPEC §11): 1 to 20 ASCII digits, at most 2^64−1,
/// no leading zero (except `0`), as a token's counter, so that one number has one
/// spelling.
pub fn parse_sequence(raw: &[u8]) -> Result<u64, TokenError> {
    if raw.is_empty() {
        return Err(TokenError::Empty);
    }
    parse_part(raw)
}

fn parse_part(part: &[u8]) -> Result<u64, TokenError> {
    if part.is_empty() || part.len() > 20 || !part.iter().all(u8::is_ascii_digit) {
        return Err(TokenError::NotDigits);
    }
    if part.len() > 1 && part[0] == b'0' {
        return Err(TokenError::LeadingZero);
    }
    part.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)
            .and_then(|acc| acc.checked_add(u64::from(d - b'0')))
            .ok_or(TokenError::Overflow)
    })
}

impl std::str::FromStr for Token {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Token, TokenError> {
        Token::parse(s.as_bytes())
    }
}

impl Token {
    /// Appends the token as [`Display`](fmt::Display) writes it, without `fmt`.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        if self.epoch != 0 {
            push_decimal(out, self.epoch);
            out.push(b':');
        }
        push_decimal(out, self.counter);
    }
}

/// `v` in decimal, without a formatter or an allocation.
pub(crate) fn push_decimal(out: &mut Vec<u8>, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Prints the canonical spelling: a bare counter for epoch 0, so parse(print(t)) == t
/// and print(parse(s)) == s for every valid s that is already canonical.
impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.epoch == 0 {
            write!(f, "{}", self.counter)
        } else {
            write!(f, "{}:{}", self.epoch, self.counter)
        }
    }
}

impl serde::Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Token {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Token, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grammar() {
        assert_eq!(Token::parse(b"0"), Ok(Token::new(0, 0)));
        assert_eq!(Token::parse(b"41"), Ok(Token::new(0, 41)));
        assert_eq!(Token::parse(b"1:5"), Ok(Token::new(1, 5)));
        assert_eq!(Token::parse(b"0:7"), Ok(Token::new(0, 7)));
        assert_eq!(
            Token::parse(b"18446744073709551615"),
            Ok(Token::new(0, u64::MAX))
        );
        assert_eq!(
            Token::parse(b"18446744073709551616"),
            Err(TokenError::Overflow)
        );
        assert_eq!(
            Token::parse(b"99999999999999999999"),
            Err(TokenError::Overflow)
        );
        assert_eq!(
            Token::parse(b"100000000000000000000"),
            Err(TokenError::NotDigits)
        );
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b" 1",
            b"1 ",
            b"01",
            b"00",
            b"1:01",
            b"1:",
            b":1",
            b"1:2:3",
            b"1,2",
            b"0x1",
            b"1.0",
            b"\xff",
            b"1:-2",
        ] {
            assert!(Token::parse(bad).is_err(), "{:?} must be malformed", bad);
        }
    }

    #[test]
    fn ordering_is_epoch_then_counter() {
        let a: Token = "999999".parse().unwrap();
        let b: Token = "1:0".parse().unwrap();
        let c: Token = "1:5".parse().unwrap();
        assert!(a < b && b < c);
    }

    proptest! {
        #[test]
        fn write_to_matches_display(epoch: u64, counter: u64) {
            let t = Token::new(epoch, counter);
            let mut out = Vec::new();
            t.write_to(&mut out);
            prop_assert_eq!(String::from_utf8(out).unwrap(), t.to_string());
        }

        #[test]
        fn print_parse_round_trips(epoch: u64, counter: u64) {
            let t = Token::new(epoch, counter);
            prop_assert_eq!(Token::parse(t.to_string().as_bytes()), Ok(t));
        }

        #[test]
        fn order_matches_tuple_order(a: (u64, u64), b: (u64, u64)) {
            prop_assert_eq!(Token::new(a.0, a.1).cmp(&Token::new(b.0, b.1)), a.cmp(&b));
        }

        #[test]
        fn parse_never_panics_and_accepts_only_canonical(raw in proptest::collection::vec(any::<u8>(), 0..48)) {
            if let Ok(t) = Token::parse(&raw) {
                // Accepted spellings are canonical, except the explicit `0:` epoch form.
                let printed = t.to_string();
                let explicit = format!("{}:{}", t.epoch, t.counter);
                prop_assert!(raw == printed.as_bytes() || raw == explicit.as_bytes());
            }
        }
    }
}

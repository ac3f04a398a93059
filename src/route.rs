//! Canonical request paths, route templates, the first-match router and scope rendering
//! (SPEC §2).
//!
//! Security rests on one rule: routes are matched, and scopes rendered, on the
//! percent-decoded segments, and any path whose decoded form is ambiguous (empty, `.`/`..`,
//! embedded `/` or `\`, controls, bad UTF-8, bad escapes) is refused. So two spellings of
//! one backend object can never land in two scopes.

use std::borrow::Cow;
use std::fmt;

use smallvec::SmallVec;

/// A canonical path's decoded segments: up to 8 without an allocation.
pub type Segments<'a> = SmallVec<[Cow<'a, str>; 8]>;

/// A route's captured values, in template order: up to 4 without an allocation.
pub type Captures<'a> = SmallVec<[Capture<'a>; 4]>;

/// Why a request target was refused with 400 `invalid_path`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the request target is not in origin form")]
    NotOriginForm,
    #[error("the path has an empty segment")]
    EmptySegment,
    #[error("a path segment is `.` or `..`")]
    DotSegment,
    #[error("a path segment has a malformed percent escape")]
    BadEscape,
    #[error("a path segment decodes to `/`, `\\`, NUL or a control character")]
    ForbiddenCharacter,
    #[error("a path segment is not valid UTF-8 once decoded")]
    NotUtf8,
    #[error(
        "a path segment has a raw `;` (path parameters to some backends, part of the name to others); escape it as %3B"
    )]
    Semicolon,
}

/// Why a route's path or scope template is refused (its text follows the key's place in
/// `check-config`'s output).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    #[error("must start with `/`")]
    NoLeadingSlash,
    #[error("capture `{0}` is named twice")]
    NamedTwice(String),
    #[error("has an empty segment")]
    EmptySegment,
    #[error("capture `{0}` needs a name of letters, digits and `_`")]
    CaptureName(String),
    #[error("`{0}` must be the last segment")]
    RestNotLast(String),
    #[error("segment `{0}` mixes text and a capture; a capture is a whole segment")]
    Mixed(String),
    #[error("segment `{0}` has `%`: write literal segments decoded, they match decoded paths")]
    Escaped(String),
    #[error("segment `{segment}`: {source}")]
    Segment {
        segment: String,
        #[source]
        source: PathError,
    },
    #[error("must not be empty")]
    Empty,
    #[error("must not contain control characters")]
    Control,
    #[error("unclosed `{{` in `{0}`")]
    Unclosed(String),
    #[error("`{{{0}}}` is not a capture of the path template")]
    NotACapture(String),
    #[error("stray `}}` in `{0}`")]
    Stray(String),
}

/// Splits an origin-form path (no query) into percent-decoded segments.
///
/// `/` is the empty list. One trailing slash is ignored (`/a/` and `/a` share a scope,
/// which is the safe direction: a WebDAV collection and its name cannot be fenced apart).
/// A raw `;` is refused: backends read it two ways. Servlet containers (Tomcat, Jetty,
/// Spring) drop a segment's `;parameters` before they resolve a path, so there
/// `/reports/july;v=1/x` is `july`'s object and `/a/..;/b` is `/b`; RFC 3986 backends (S3,
/// nginx) keep `;` as part of the name, so there `q3;d` and `q3%3Bd` are one object. No one
/// reading of a raw `;` gives both kinds of backend one scope per object (and the same
/// route: cutting parameters would let `/public;x/…` reach a pass-through `/public` route
/// while an S3 backend writes `public;x/…`). An escaped `%3B` is a character of the name to
/// both, and is accepted.
pub fn canonicalize(path: &str) -> Result<Segments<'_>, PathError> {
    let rest = path.strip_prefix('/').ok_or(PathError::NotOriginForm)?;
    if rest.is_empty() {
        return Ok(Segments::new());
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    // One pass over the bytes finds the slashes and whether each segment is plain
    // printable ASCII without escapes, backslashes or `;` (nearly all are: borrowed, no
    // copy); any other segment takes the decoding path, which refuses a backslash and a
    // raw `;` too.
    let mut out = Segments::new();
    let (mut start, mut plain) = (0, true);
    for (i, &b) in rest.as_bytes().iter().enumerate() {
        match BYTE_CLASS[usize::from(b)] {
            SLASH => {
                // `/` is ASCII: both ends are character boundaries.
                out.push(segment(rest.get(start..i).unwrap_or_default(), plain)?);
                (start, plain) = (i + 1, true);
            }
            OTHER => plain = false,
            _ => {}
        }
    }
    out.push(segment(rest.get(start..).unwrap_or_default(), plain)?);
    Ok(out)
}

/// Printable ASCII other than `%`, `\` and `;`: a byte that stands for itself in a
/// segment.
const fn is_plain(b: u8) -> bool {
    matches!(b, 0x20..=0x7e) && b != b'%' && b != b'\\' && b != b';'
}

/// What [`canonicalize`]'s loop asks of each byte, in one load rather than tested by
/// ranges (W1 -64 instructions per request, `benches/callgrind.sh`); the test
/// `the_byte_table_agrees_with_is_plain` checks it byte by byte.
const PLAIN: u8 = 0;
const SLASH: u8 = 1;
const OTHER: u8 = 2;
static BYTE_CLASS: [u8; 256] = {
    let mut class = [OTHER; 256];
    let mut b = 0;
    while b < 256 {
        if b == b'/' as usize {
            class[b] = SLASH;
        } else if is_plain(b as u8) {
            class[b] = PLAIN;
        }
        b += 1;
    }
    class
};

/// One segment, `plain` if every byte [`is_plain`] (known to the caller, which has
/// looked at each byte already). Most segments are: borrowed, no copy. Anything else is
/// percent-decoded, which refuses a backslash too.
fn segment(raw: &str, plain: bool) -> Result<Cow<'_, str>, PathError> {
    if !plain {
        return decode_escaped(raw);
    }
    match raw {
        "" => Err(PathError::EmptySegment),
        "." | ".." => Err(PathError::DotSegment),
        _ => Ok(Cow::Borrowed(raw)),
    }
}

/// Whether `text`, one segment already decoded (an S3 key named in a request body, split
/// at `/`), is one that [`canonicalize`] would accept: not empty, `.` or `..`, and without
/// `/`, `\`, NUL or a control character.
pub fn check_decoded(text: &str) -> Result<(), PathError> {
    match text {
        "" => Err(PathError::EmptySegment),
        "." | ".." => Err(PathError::DotSegment),
        _ if text
            .bytes()
            .any(|b| matches!(b, b'/' | b'\\' | 0x00..=0x1f | 0x7f))
            || text.chars().any(char::is_control) =>
        {
            Err(PathError::ForbiddenCharacter)
        }
        _ => Ok(()),
    }
}

fn decode_segment(raw: &str) -> Result<Cow<'_, str>, PathError> {
    segment(raw, raw.bytes().all(is_plain))
}

/// The decoding path of [`segment`], for a segment with at least one byte that is not
/// [`is_plain`]. Kept out of line (rare), so that [`segment`] stays small enough to inline
/// into the loop of [`canonicalize`] (measured: the plain path 29 → 26 ns, 11 segments
/// 65 → 50 ns in `cargo bench --bench micro -- route`).
#[inline(never)]
fn decode_escaped(raw: &str) -> Result<Cow<'_, str>, PathError> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b';' {
            return Err(PathError::Semicolon);
        }
        if b == b'%' {
            let hi = bytes.get(i + 1).and_then(|c| (*c as char).to_digit(16));
            let lo = bytes.get(i + 2).and_then(|c| (*c as char).to_digit(16));
            match (hi, lo) {
                (Some(hi), Some(lo)) => out.push((hi * 16 + lo) as u8),
                _ => return Err(PathError::BadEscape),
            }
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    if out
        .iter()
        .any(|b| matches!(b, b'/' | b'\\' | 0x00..=0x1f | 0x7f))
    {
        return Err(PathError::ForbiddenCharacter);
    }
    let text = String::from_utf8(out).map_err(|_| PathError::NotUtf8)?;
    if text == "." || text == ".." {
        return Err(PathError::DotSegment);
    }
    if text.chars().any(char::is_control) {
        return Err(PathError::ForbiddenCharacter);
    }
    Ok(Cow::Owned(text))
}

/// One segment of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    /// `{name}`: exactly one non-empty segment.
    Param(String),
    /// `{*name}`: the rest of the path, one or more segments; only last.
    CatchAll(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    pub segments: Vec<Segment>,
    raw: String,
}

impl fmt::Display for PathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

impl PathTemplate {
    pub fn parse(raw: &str) -> Result<PathTemplate, TemplateError> {
        let rest = raw.strip_prefix('/').ok_or(TemplateError::NoLeadingSlash)?;
        let mut segments = Vec::new();
        if !rest.is_empty() {
            let parts: Vec<&str> = rest.split('/').collect();
            for (i, part) in parts.iter().enumerate() {
                let last = i + 1 == parts.len();
                segments.push(parse_template_segment(part, last)?);
            }
        }
        let mut names: Vec<&str> = segments
            .iter()
            .filter_map(|s| match s {
                Segment::Param(n) | Segment::CatchAll(n) => Some(n.as_str()),
                Segment::Literal(_) => None,
            })
            .collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(TemplateError::NamedTwice(w[0].to_string()));
        }
        Ok(PathTemplate {
            segments,
            raw: raw.to_string(),
        })
    }

    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param(n) | Segment::CatchAll(n) => Some(n.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Matches a path shorter than the template whose segments the template's first ones
    /// take (literals equal, captures one each): an S3 route's `/{bucket}` and `/`. The
    /// captures are those of the segments there are.
    pub fn matches_prefix<'a>(&self, path: &'a [Cow<'a, str>]) -> Option<Captures<'a>> {
        if path.len() >= self.segments.len() {
            return None;
        }
        let mut caps = Captures::new();
        for (seg, text) in self.segments.iter().zip(path) {
            match seg {
                Segment::Literal(lit) if lit == text => {}
                Segment::Param(_) => caps.push(Capture::One(text.as_ref())),
                _ => return None,
            }
        }
        Some(caps)
    }

    /// Matches decoded segments; returns the captured values in template order.
    pub fn matches<'a>(&self, path: &'a [Cow<'a, str>]) -> Option<Captures<'a>> {
        let mut caps = Captures::new();
        for (i, seg) in self.segments.iter().enumerate() {
            match seg {
                Segment::Literal(lit) => {
                    if path.get(i)?.as_ref() != lit.as_str() {
                        return None;
                    }
                }
                Segment::Param(_) => caps.push(Capture::One(path.get(i)?.as_ref())),
                Segment::CatchAll(_) => {
                    let rest = path.get(i..).filter(|r| !r.is_empty())?;
                    caps.push(Capture::Rest(rest));
                    return Some(caps);
                }
            }
        }
        (path.len() == self.segments.len()).then_some(caps)
    }

    /// A path that both templates match, if there is one (written with `a` for a capture
    /// that the other template leaves free).
    pub fn overlap(&self, other: &PathTemplate) -> Option<String> {
        let mut path = String::new();
        for i in 0.. {
            let seg = match (self.segments.get(i), other.segments.get(i)) {
                (None, None) => return Some(if path.is_empty() { "/".into() } else { path }),
                (None, Some(_)) | (Some(_), None) => return None,
                (Some(Segment::CatchAll(_)), Some(rest))
                | (Some(rest), Some(Segment::CatchAll(_))) => {
                    // The catch-all takes whatever the other one needs from here on.
                    let tail = if std::ptr::eq(rest, &self.segments[i]) {
                        self
                    } else {
                        other
                    };
                    for s in &tail.segments[i..] {
                        path.push('/');
                        path.push_str(match s {
                            Segment::Literal(l) => l,
                            _ => "a",
                        });
                    }
                    return Some(path);
                }
                (Some(Segment::Literal(a)), Some(Segment::Literal(b))) if a != b => return None,
                (Some(Segment::Literal(l)), _) | (_, Some(Segment::Literal(l))) => l.as_str(),
                (Some(_), Some(_)) => "a",
            };
            path.push('/');
            path.push_str(seg);
        }
        None
    }

    /// The paths both templates match, as one template (its captures named `c0`, `c1`,
    /// ...), if there are any. Where [`overlap`](Self::overlap) gives one such path, this
    /// gives all of them, so that a check can ask whether another route takes them all.
    pub fn intersection(&self, other: &PathTemplate) -> Option<PathTemplate> {
        let mut segments = Vec::new();
        let mut fresh = 0usize;
        let mut capture = |catch_all: bool| {
            let name = format!("c{fresh}");
            fresh += 1;
            if catch_all {
                Segment::CatchAll(name)
            } else {
                Segment::Param(name)
            }
        };
        for i in 0.. {
            match (self.segments.get(i), other.segments.get(i)) {
                (None, None) => break,
                (None, Some(_)) | (Some(_), None) => return None,
                (Some(Segment::CatchAll(_)), Some(Segment::CatchAll(_))) => {
                    segments.push(capture(true));
                    break;
                }
                // The catch-all takes whatever the other one asks of the rest (at least
                // one segment, which the other has: it has one here).
                (Some(mine), Some(theirs))
                    if matches!(mine, Segment::CatchAll(_))
                        || matches!(theirs, Segment::CatchAll(_)) =>
                {
                    let tail = if matches!(mine, Segment::CatchAll(_)) {
                        &other.segments[i..]
                    } else {
                        &self.segments[i..]
                    };
                    for s in tail {
                        segments.push(match s {
                            Segment::Literal(l) => Segment::Literal(l.clone()),
                            Segment::Param(_) => capture(false),
                            Segment::CatchAll(_) => capture(true),
                        });
                    }
                    break;
                }
                (Some(Segment::Literal(a)), Some(Segment::Literal(b))) if a != b => return None,
                (Some(Segment::Literal(l)), _) | (_, Some(Segment::Literal(l))) => {
                    segments.push(Segment::Literal(l.clone()));
                }
                (Some(_), Some(_)) => segments.push(capture(false)),
            }
        }
        let mut raw = String::new();
        for s in &segments {
            raw.push('/');
            match s {
                Segment::Literal(l) => raw.push_str(l),
                Segment::Param(n) => raw.push_str(&format!("{{{n}}}")),
                Segment::CatchAll(n) => raw.push_str(&format!("{{*{n}}}")),
            }
        }
        if raw.is_empty() {
            raw.push('/');
        }
        Some(PathTemplate { segments, raw })
    }

    /// One path this template matches, written with `a` for each capture (as
    /// [`overlap`](Self::overlap) writes its examples).
    pub fn example(&self) -> String {
        let mut path = String::new();
        for s in &self.segments {
            path.push('/');
            path.push_str(match s {
                Segment::Literal(l) => l,
                Segment::Param(_) | Segment::CatchAll(_) => "a",
            });
        }
        if path.is_empty() {
            path.push('/');
        }
        path
    }

    /// Do both templates match the same paths, capturing the same segments in the same
    /// order, whatever the captures are called? Then a scope template's n-th capture is
    /// one value under either ([`ScopeTemplate::renders_like`]).
    pub fn same_shape(&self, other: &PathTemplate) -> bool {
        self.segments.len() == other.segments.len()
            && self
                .segments
                .iter()
                .zip(&other.segments)
                .all(|pair| match pair {
                    (Segment::Literal(a), Segment::Literal(b)) => a == b,
                    (Segment::Param(_), Segment::Param(_))
                    | (Segment::CatchAll(_), Segment::CatchAll(_)) => true,
                    _ => false,
                })
    }

    /// True when every path this template matches is also matched by `earlier`
    /// (so a later route with this template can never be reached).
    pub fn is_covered_by(&self, earlier: &PathTemplate) -> bool {
        for (i, e) in earlier.segments.iter().enumerate() {
            let Some(mine) = self.segments.get(i) else {
                return false;
            };
            match (e, mine) {
                (Segment::CatchAll(_), _) => return true,
                (Segment::Param(_), Segment::Literal(_) | Segment::Param(_)) => {}
                (Segment::Literal(a), Segment::Literal(b)) if a == b => {}
                _ => return false,
            }
        }
        self.segments.len() == earlier.segments.len()
    }
}

fn parse_template_segment(part: &str, last: bool) -> Result<Segment, TemplateError> {
    if part.is_empty() {
        return Err(TemplateError::EmptySegment);
    }
    if let Some(inner) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
        let (name, catch_all) = match inner.strip_prefix('*') {
            Some(n) => (n, true),
            None => (inner, false),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(TemplateError::CaptureName(part.to_string()));
        }
        if catch_all && !last {
            return Err(TemplateError::RestNotLast(part.to_string()));
        }
        return Ok(if catch_all {
            Segment::CatchAll(name.to_string())
        } else {
            Segment::Param(name.to_string())
        });
    }
    if part.contains(['{', '}']) {
        return Err(TemplateError::Mixed(part.to_string()));
    }
    if part.contains('%') {
        return Err(TemplateError::Escaped(part.to_string()));
    }
    match decode_segment(part) {
        Ok(text) => Ok(Segment::Literal(text.into_owned())),
        Err(source) => Err(TemplateError::Segment {
            segment: part.to_string(),
            source,
        }),
    }
}

/// A captured value: one segment, or the rest of the path.
#[derive(Debug, Clone, Copy)]
pub enum Capture<'a> {
    One(&'a str),
    Rest(&'a [Cow<'a, str>]),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ScopePart {
    Text(String),
    /// Index into the path template's captures.
    Capture(usize),
}

/// A scope template: text with `{name}` references to the path's captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeTemplate {
    parts: Vec<ScopePart>,
    raw: String,
}

impl fmt::Display for ScopeTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

impl ScopeTemplate {
    pub fn parse(raw: &str, path: &PathTemplate) -> Result<ScopeTemplate, TemplateError> {
        if raw.is_empty() {
            return Err(TemplateError::Empty);
        }
        // No request's scope can hold one (a path segment with one is refused), and the
        // store's other records are told from marks' by a leading NUL.
        if raw.chars().any(char::is_control) {
            return Err(TemplateError::Control);
        }
        let names: Vec<&str> = path.captures().collect();
        let mut parts = Vec::new();
        let mut rest = raw;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(ScopePart::Text(rest[..open].to_string()));
            }
            let after = &rest[open + 1..];
            let close = after
                .find('}')
                .ok_or_else(|| TemplateError::Unclosed(raw.to_string()))?;
            let name = &after[..close];
            let idx = names
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| TemplateError::NotACapture(name.to_string()))?;
            parts.push(ScopePart::Capture(idx));
            rest = &after[close + 1..];
        }
        if rest.contains('}') {
            return Err(TemplateError::Stray(raw.to_string()));
        }
        if !rest.is_empty() {
            parts.push(ScopePart::Text(rest.to_string()));
        }
        Ok(ScopeTemplate {
            parts,
            raw: raw.to_string(),
        })
    }

    /// Does this template render what `other` renders, for templates over path templates
    /// of the same shape ([`PathTemplate::same_shape`])? Captures are compared by their
    /// place in the path, not by name: `report/{r}` renders like `report/{report}`.
    pub fn renders_like(&self, other: &ScopeTemplate) -> bool {
        self.parts == other.parts
    }

    /// Does the template render capture `i` anywhere?
    pub fn uses_capture(&self, i: usize) -> bool {
        self.parts.contains(&ScopePart::Capture(i))
    }

    /// Does the template end with capture `i` (so that the scopes it renders for every
    /// value of that capture share the prefix rendered before it)?
    pub fn ends_with_capture(&self, i: usize) -> bool {
        self.parts.last() == Some(&ScopePart::Capture(i))
    }

    /// Does the template render none of the captures numbered `n` and above (so that the
    /// first `n` captures alone decide the scope)?
    pub fn uses_captures_below(&self, n: usize) -> bool {
        self.parts
            .iter()
            .all(|p| !matches!(p, ScopePart::Capture(i) if *i >= n))
    }

    pub fn is_constant(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, ScopePart::Text(_)))
    }

    /// Two captures of `path` that this template joins with no `/` between them, if any:
    /// a capture may hold any character but `/`, so two paths can render one scope
    /// (`{a}:{b}` gives `x:y:z` for `x:y` and `z`, and for `x` and `y:z`).
    pub fn ambiguous_captures(&self, path: &PathTemplate) -> Option<(String, String)> {
        let names: Vec<&str> = path.captures().collect();
        let mut last: Option<usize> = None;
        let mut slash = false;
        for part in &self.parts {
            match part {
                ScopePart::Text(t) => slash |= t.contains('/'),
                ScopePart::Capture(i) => {
                    if let Some(prev) = last.filter(|_| !slash) {
                        let name = |k: usize| names.get(k).map_or("?", |n| *n).to_string();
                        return Some((name(prev), name(*i)));
                    }
                    (last, slash) = (Some(*i), false);
                }
            }
        }
        None
    }

    pub fn render(&self, caps: &[Capture<'_>]) -> String {
        let mut out = String::with_capacity(self.raw.len() + 16);
        for part in &self.parts {
            match part {
                ScopePart::Text(t) => out.push_str(t),
                ScopePart::Capture(i) => match caps.get(*i) {
                    Some(Capture::One(s)) => out.push_str(s),
                    Some(Capture::Rest(segs)) => {
                        for (n, s) in segs.iter().enumerate() {
                            if n > 0 {
                                out.push('/');
                            }
                            out.push_str(s);
                        }
                    }
                    None => {}
                },
            }
        }
        out
    }
}

/// What a scope template's capture may hold, for [`ScopeTemplate::can_meet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureKind {
    /// One path segment: one or more characters, none of them `/`.
    Segment,
    /// The rest of a path: segments joined by `/`.
    Segments,
    /// Any non-empty text (an S3 key read whole).
    Any,
}

/// One step of a scope pattern: a literal character or a capture.
#[derive(Clone, Copy)]
enum Step {
    Char(char),
    Capture(CaptureKind),
}

/// Where a pattern's reader is: before step `at` (`phase` 0), inside a capture that has
/// read a character (1), or inside `Segments` just after a `/` (2).
type State = (usize, u8);

impl ScopeTemplate {
    fn steps(&self, kinds: &[CaptureKind]) -> Vec<Step> {
        let mut out = Vec::new();
        for part in &self.parts {
            match part {
                ScopePart::Text(t) => out.extend(t.chars().map(Step::Char)),
                ScopePart::Capture(i) => out.push(Step::Capture(
                    kinds.get(*i).copied().unwrap_or(CaptureKind::Any),
                )),
            }
        }
        out
    }

    /// Can this template (whose captures hold `kinds`) and `other` (with `theirs`) render
    /// one and the same scope? Decided exactly, on the product of the two patterns'
    /// automata over the characters their texts hold, `/`, and one character neither
    /// holds (which stands for every other).
    pub fn can_meet(
        &self,
        kinds: &[CaptureKind],
        other: &ScopeTemplate,
        theirs: &[CaptureKind],
    ) -> bool {
        let (a, b) = (self.steps(kinds), other.steps(theirs));
        let mut alphabet: Vec<char> = a
            .iter()
            .chain(&b)
            .filter_map(|s| match s {
                Step::Char(c) => Some(*c),
                Step::Capture(_) => None,
            })
            .chain(['/'])
            .collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        // A character that is in no text (and is not `/`): all others behave like it.
        let other_char = ('\u{E000}'..)
            .find(|c| !alphabet.contains(c))
            .unwrap_or('\u{E000}');
        alphabet.push(other_char);
        let start = (closure(&a, (0, 0)), closure(&b, (0, 0)));
        let mut seen = std::collections::HashSet::new();
        let mut todo = vec![start];
        while let Some((x, y)) = todo.pop() {
            if x.contains(&(a.len(), 0)) && y.contains(&(b.len(), 0)) {
                return true;
            }
            if !seen.insert((x.clone(), y.clone())) {
                continue;
            }
            for &c in &alphabet {
                let nx = advance(&a, &x, c);
                let ny = advance(&b, &y, c);
                if !nx.is_empty() && !ny.is_empty() {
                    todo.push((nx, ny));
                }
            }
        }
        false
    }
}

/// The states reachable from `s` without reading (a capture that has read enough may
/// end), sorted.
fn closure(steps: &[Step], s: State) -> Vec<State> {
    let mut out = vec![s];
    if s.1 == 1 && matches!(steps.get(s.0), Some(Step::Capture(_))) {
        out.extend(closure(steps, (s.0 + 1, 0)));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The states after reading `c` from any of `states`.
fn advance(steps: &[Step], states: &[State], c: char) -> Vec<State> {
    let mut out = Vec::new();
    for &(at, phase) in states {
        let next: Option<State> = match (steps.get(at), phase) {
            (Some(Step::Char(want)), 0) => (*want == c).then_some((at + 1, 0)),
            (Some(Step::Capture(CaptureKind::Any)), _) => Some((at, 1)),
            (Some(Step::Capture(CaptureKind::Segment)), _) => (c != '/').then_some((at, 1)),
            (Some(Step::Capture(CaptureKind::Segments)), 1) if c == '/' => Some((at, 2)),
            (Some(Step::Capture(CaptureKind::Segments)), _) => (c != '/').then_some((at, 1)),
            _ => None,
        };
        if let Some(n) = next {
            out.extend(closure(steps, n));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// What the router needs of a route; the config owns the rest.
pub trait RouteMatch {
    fn path(&self) -> &PathTemplate;
    fn host(&self) -> Option<&str>;
    /// The route also takes the paths its template's leading segments match (see
    /// [`PathTemplate::matches_prefix`]): an S3 route owns its buckets and the service.
    fn takes_prefixes(&self) -> bool {
        false
    }
}

/// First match in file order. `host` is the request's host without its port.
pub fn find<'r, 'p, R: RouteMatch>(
    routes: &'r [R],
    host: Option<&str>,
    path: &'p [Cow<'p, str>],
) -> Option<(usize, &'r R, Captures<'p>)> {
    routes.iter().enumerate().find_map(|(i, r)| {
        if let Some(want) = r.host()
            && !host.is_some_and(|h| h.eq_ignore_ascii_case(want))
        {
            return None;
        }
        let caps = r.path().matches(path).or_else(|| {
            r.takes_prefixes()
                .then(|| r.path().matches_prefix(path))
                .flatten()
        })?;
        Some((i, r, caps))
    })
}

/// The bytes of an RFC 3986 reg-name: unreserved, pct-encoded and sub-delims (no `@`, no
/// `:`), as a table (one lookup per byte).
const HOST_BYTE: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u8;
        t[i] = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
            );
        i += 1;
    }
    t
};

/// The host of a Host/authority value, without its port and without one trailing dot
/// (`files.internal.` names the same host as `files.internal`, and backends such as nginx
/// match it so); IPv6 brackets stay. Anything that is not an authority's `host[:port]` is
/// an error: an empty value, userinfo, a port that is not a number, a character a host
/// cannot hold. The router must not fall past a `host =` route on a spelling the backend
/// reads as that host.
pub fn host_of(authority: &str) -> Result<&str, &'static str> {
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']').ok_or("an IPv6 host without its `]`")?;
        let (host, rest) = authority.split_at(end + 1);
        let port = match rest.strip_prefix(':') {
            Some(p) => p,
            None if rest.is_empty() => "",
            None => return Err("text after an IPv6 host"),
        };
        let inner = &host[1..end];
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return Err("not an IPv6 address");
        }
        (host, port)
    } else {
        // One pass: every byte up to the first `:` (which no host name holds) must be one
        // a host name may hold.
        let bytes = authority.as_bytes();
        let mut split = bytes.len();
        for (i, &b) in bytes.iter().enumerate() {
            if b == b':' {
                split = i;
                break;
            }
            if !HOST_BYTE[usize::from(b)] {
                return Err("a character no host name has");
            }
        }
        let host = &authority[..split];
        let port = authority.get(split + 1..).unwrap_or("");
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.is_empty() {
            return Err("no host");
        }
        (host, port)
    };
    if !port.is_empty()
        && (port.len() > 5
            || !port.bytes().all(|b| b.is_ascii_digit())
            || port.parse::<u16>().is_err())
    {
        return Err("a port that is not a number below 65536");
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scope_of(path_t: &str, scope_t: &str, path: &str) -> Option<String> {
        let pt = PathTemplate::parse(path_t).unwrap();
        let st = ScopeTemplate::parse(scope_t, &pt).unwrap();
        let segs = canonicalize(path).ok()?;
        pt.matches(&segs).map(|c| st.render(&c))
    }

    #[test]
    fn the_byte_table_agrees_with_is_plain() {
        for b in 0..=u8::MAX {
            let want = match b {
                b'/' => SLASH,
                _ if is_plain(b) => PLAIN,
                _ => OTHER,
            };
            assert_eq!(BYTE_CLASS[usize::from(b)], want, "byte {b:#04x}");
        }
    }

    #[test]
    fn aliases_share_a_scope() {
        let t = ("/reports/{report}/{*rest}", "report/{report}");
        for p in [
            "/reports/july/x",
            "/reports/jul%79/x",
            "/r%65ports/july/x",
            "/reports/july/x/",
            "/reports/%6A%75%6C%79/x",
        ] {
            assert_eq!(scope_of(t.0, t.1, p).as_deref(), Some("report/july"), "{p}");
        }
        assert_eq!(
            scope_of("/o/{k}", "k/{k}", "/o/a:b"),
            scope_of("/o/{k}", "k/{k}", "/o/a%3Ab")
        );
        assert_eq!(
            scope_of("/o/{*k}", "k/{k}", "/o/a/b/c").as_deref(),
            Some("k/a/b/c")
        );
    }

    #[test]
    fn refuses_unsafe_paths() {
        use PathError::*;
        let cases: &[(&str, PathError)] = &[
            ("reports/x", NotOriginForm),
            ("*", NotOriginForm),
            ("//x", EmptySegment),
            ("/a//b", EmptySegment),
            ("/a/./b", DotSegment),
            ("/a/../b", DotSegment),
            ("/a/%2e%2E/b", DotSegment),
            ("/a/%2e/b", DotSegment),
            ("/a%2fb", ForbiddenCharacter),
            ("/a%2Fb", ForbiddenCharacter),
            ("/a%5cb", ForbiddenCharacter),
            ("/a%00b", ForbiddenCharacter),
            ("/a%0ab", ForbiddenCharacter),
            ("/a%7f", ForbiddenCharacter),
            ("/a%c2%85", ForbiddenCharacter),
            ("/a%ff", NotUtf8),
            ("/a%zz", BadEscape),
            ("/a%4", BadEscape),
            ("/a%", BadEscape),
        ];
        for (p, e) in cases {
            assert_eq!(canonicalize(p).as_ref(), Err(e), "{p}");
        }
        assert_eq!(canonicalize("/"), Ok(Segments::new()));
    }

    /// A raw `;` is read two ways (servlet path parameters, or part of the name): refused,
    /// so no reading gives one object two scopes or sends it down another route. `%3B` is
    /// part of the name to every backend.
    #[test]
    fn a_raw_semicolon_is_refused_and_an_escaped_one_is_a_character() {
        for p in [
            "/reports/july;v=1/x",
            "/reports/july/..;/august/x",
            "/a/;x/b",
            "/a;b/",
            "/;",
            "/jul%79;x/y",
        ] {
            assert_eq!(canonicalize(p), Err(PathError::Semicolon), "{p}");
        }
        let segs: Vec<String> = canonicalize("/a%3Bb/c")
            .expect("escaped")
            .iter()
            .map(|c| c.to_string())
            .collect();
        assert_eq!(segs, ["a;b", "c"]);
        assert_eq!(
            scope_of("/reports/{r}/{*rest}", "report/{r}", "/reports/q3%3Bd/x").as_deref(),
            Some("report/q3;d")
        );
        assert!(
            PathTemplate::parse("/a;b/{x}").is_err(),
            "a template segment with `;`"
        );
    }

    #[test]
    fn overlaps_and_shared_scopes() {
        let t = |p: &str| PathTemplate::parse(p).unwrap();
        let o = |a: &str, b: &str| t(a).overlap(&t(b));
        assert_eq!(o("/a/{x}", "/{y}/b").as_deref(), Some("/a/b"));
        assert_eq!(o("/a/{x}", "/b/{y}"), None);
        assert_eq!(o("/a/{x}", "/a/{x}/c"), None);
        assert_eq!(o("/a/{*r}", "/{y}/b/c").as_deref(), Some("/a/b/c"));
        assert_eq!(o("/{y}/b/c", "/a/{*r}").as_deref(), Some("/a/b/c"));
        assert_eq!(o("/a/{*r}", "/a"), None);
        assert_eq!(o("/{*r}", "/{*s}").as_deref(), Some("/a"));
        assert_eq!(o("/", "/").as_deref(), Some("/"));
        let amb = |p: &str, s: &str| {
            ScopeTemplate::parse(s, &t(p))
                .unwrap()
                .ambiguous_captures(&t(p))
        };
        assert_eq!(amb("/{a}/{b}", "s/{a}/{b}"), None);
        assert_eq!(amb("/{a}/{*b}", "{a}/x/{b}"), None);
        assert_eq!(amb("/{a}/{*b}", "{b}/{a}"), None);
        assert_eq!(amb("/{a}/{b}", "s/{a}-{b}"), Some(("a".into(), "b".into())));
        assert_eq!(amb("/{a}/{b}", "{b}{a}"), Some(("b".into(), "a".into())));
        assert_eq!(amb("/{a}/{b}", "s/{a}"), None);
    }

    /// The intersection matches exactly the paths both templates match; its example is
    /// one of them.
    #[test]
    fn intersections_and_shapes() {
        let t = |p: &str| PathTemplate::parse(p).unwrap();
        let i = |a: &str, b: &str| t(a).intersection(&t(b)).map(|x| x.to_string());
        assert_eq!(
            i("/{b}/{*k}", "/reports/{r}/{*o}").as_deref(),
            Some("/reports/{c0}/{*c1}")
        );
        assert_eq!(
            i("/reports/{r}/{*o}", "/{b}/{*k}").as_deref(),
            Some("/reports/{c0}/{*c1}")
        );
        assert_eq!(i("/a/{*r}", "/{x}/{*s}").as_deref(), Some("/a/{*c0}"));
        assert_eq!(i("/a/{x}", "/{y}/b").as_deref(), Some("/a/b"));
        assert_eq!(i("/{*r}", "/a/{x}/c").as_deref(), Some("/a/{c0}/c"));
        assert_eq!(i("/", "/").as_deref(), Some("/"));
        assert_eq!(i("/a/{x}", "/b/{y}"), None);
        assert_eq!(i("/a/{*r}", "/a"), None);
        assert_eq!(i("/a", "/a/{*r}"), None);
        assert_eq!(i("/a/{x}", "/a/{x}/c"), None);
        let shared = t("/{b}/{*k}")
            .intersection(&t("/reports/{r}/{*o}"))
            .unwrap();
        assert_eq!(shared.example(), "/reports/a/a");
        assert!(shared.is_covered_by(&t("/reports/{report}/{*object}")));
        assert!(!shared.is_covered_by(&t("/reports/{report}/x")));
        assert_eq!(t("/").example(), "/");

        assert!(t("/r/{a}/{*b}").same_shape(&t("/r/{x}/{*y}")));
        assert!(!t("/r/{a}/{*b}").same_shape(&t("/r/{a}/{b}")));
        assert!(!t("/r/{a}").same_shape(&t("/s/{a}")));
        assert!(!t("/r/{a}").same_shape(&t("/r/{a}/{b}")));
        let s = |p: &str, s: &str| ScopeTemplate::parse(s, &t(p)).unwrap();
        assert!(s("/r/{a}/{*b}", "r/{a}").renders_like(&s("/r/{x}/{*y}", "r/{x}")));
        assert!(!s("/r/{a}/{*b}", "r/{a}").renders_like(&s("/r/{x}/{*y}", "r/{y}")));
        assert!(!s("/r/{a}", "r/{a}").renders_like(&s("/r/{a}", "t/{a}")));
    }

    proptest! {
        /// A path matches the intersection exactly when it matches both templates.
        #[test]
        fn an_intersection_matches_what_both_match(
            a in (proptest::collection::vec(0u8..3, 0..4), any::<bool>()),
            b in (proptest::collection::vec(0u8..3, 0..4), any::<bool>()),
            path in proptest::collection::vec("x|y|z", 0..6),
        ) {
            // Segments `x`, `y` or a capture, and perhaps a catch-all at the end.
            let template = |(kinds, rest): &(Vec<u8>, bool)| {
                let mut raw: String = kinds
                    .iter()
                    .enumerate()
                    .map(|(i, k)| match k {
                        0 => "/x".to_string(),
                        1 => "/y".to_string(),
                        _ => format!("/{{p{i}}}"),
                    })
                    .collect();
                if *rest {
                    raw.push_str("/{*r}");
                }
                PathTemplate::parse(if raw.is_empty() { "/" } else { &raw })
            };
            let (Ok(a), Ok(b)) = (template(&a), template(&b)) else {
                return Err(TestCaseError::fail("a template did not parse"));
            };
            let segs: Segments<'_> = path.iter().map(|s| Cow::Borrowed(s.as_str())).collect();
            let both = a.matches(&segs).is_some() && b.matches(&segs).is_some();
            let shared = a.intersection(&b);
            prop_assert_eq!(
                shared.as_ref().is_some_and(|s| s.matches(&segs).is_some()),
                both,
                "{} and {} at /{}: {:?}", a, b, path.join("/"), shared
            );
            // An overlap exists exactly when an intersection does.
            prop_assert_eq!(a.overlap(&b).is_some(), shared.is_some());
        }
    }

    #[test]
    fn templates() {
        assert!(PathTemplate::parse("/a/{*r}/b").is_err());
        assert!(PathTemplate::parse("/a/{x}/{x}").is_err());
        assert!(PathTemplate::parse("/a/x{y}").is_err());
        assert!(PathTemplate::parse("a").is_err());
        assert!(PathTemplate::parse("/a//b").is_err());
        assert!(PathTemplate::parse("/a/%41").is_err());
        let pt = PathTemplate::parse("/a/{x}").unwrap();
        assert!(ScopeTemplate::parse("s/{y}", &pt).is_err());
        assert!(ScopeTemplate::parse("s/{x", &pt).is_err());
        assert!(ScopeTemplate::parse("", &pt).is_err());
        assert!(ScopeTemplate::parse("all", &pt).unwrap().is_constant());
        // {*name} needs at least one segment
        let pt = PathTemplate::parse("/a/{*r}").unwrap();
        assert!(pt.matches(&canonicalize("/a").unwrap()).is_none());
        assert!(pt.matches(&canonicalize("/a/b").unwrap()).is_some());
    }

    #[test]
    fn coverage() {
        let p = |s| PathTemplate::parse(s).unwrap();
        assert!(p("/a/b").is_covered_by(&p("/a/{x}")));
        assert!(p("/a/{y}/c").is_covered_by(&p("/{x}/{*r}")));
        assert!(p("/a/{*z}").is_covered_by(&p("/a/{*r}")));
        assert!(!p("/a/{*z}").is_covered_by(&p("/a/{x}")));
        assert!(!p("/a/{x}").is_covered_by(&p("/a/b")));
        assert!(!p("/a").is_covered_by(&p("/a/{*r}")));
        assert!(!p("/a/b/c").is_covered_by(&p("/a/{x}")));
    }

    #[test]
    fn scope_templates_that_can_meet() {
        use CaptureKind::{Any, Segment, Segments};
        let t = |path: &str, scope: &str| {
            let p = PathTemplate::parse(path).expect("path");
            ScopeTemplate::parse(scope, &p).expect("scope")
        };
        let meet =
            |a: &ScopeTemplate, ka: &[CaptureKind], b: &ScopeTemplate, kb: &[CaptureKind]| {
                a.can_meet(ka, b, kb) && b.can_meet(kb, a, ka)
            };
        let raw = t("/raw/{d}", "doc/{d}");
        let docs = t("/docs/{d}", "doc/{d}");
        assert!(meet(&raw, &[Segment], &docs, &[Segment]));
        let meta = t("/m/{d}", "doc/{d}/meta");
        assert!(
            !meet(&raw, &[Segment], &meta, &[Segment]),
            "a segment holds no /"
        );
        assert!(meet(&raw, &[Segments], &meta, &[Segment]), "a rest does");
        assert!(
            !meet(&raw, &[Segment], &t("/x", "doc/"), &[]),
            "a capture is never empty"
        );
        assert!(meet(&raw, &[Segment], &t("/x", "doc/x"), &[]));
        assert!(!meet(&raw, &[Segment], &t("/x", "docs/x"), &[]));
        let two = t("/a/{x}/{y}", "{x}:{y}");
        assert!(meet(&two, &[Segment, Segment], &t("/c", "a:b:c"), &[]));
        assert!(!meet(
            &t("/r/{k}", "object/{k}"),
            &[Segments],
            &t("/b/{b}", "bucket/{b}"),
            &[Segment]
        ));
        assert!(
            meet(&t("/r/{k}", "o/{k}"), &[Any], &t("/q", "o//x"), &[]),
            "an opaque key may hold //"
        );
        assert!(!meet(
            &t("/r/{k}", "o/{k}"),
            &[Segments],
            &t("/q", "o//x"),
            &[]
        ));
    }

    #[test]
    fn host_port_is_ignored() {
        assert_eq!(host_of("Example.com:8080"), Ok("Example.com"));
        assert_eq!(host_of("example.com"), Ok("example.com"));
        assert_eq!(host_of("example.com."), Ok("example.com"));
        assert_eq!(host_of("example.com.:80"), Ok("example.com"));
        assert_eq!(host_of("example.com:"), Ok("example.com"));
        assert_eq!(host_of("[::1]:80"), Ok("[::1]"));
        assert_eq!(host_of("[::1]"), Ok("[::1]"));
        assert_eq!(host_of("10.0.0.1:8080"), Ok("10.0.0.1"));
        for bad in [
            "",
            ".",
            ":80",
            "example.com:x",
            "example.com:65536",
            "example.com:+80",
            "example.com:080000",
            "user@example.com",
            "example.com:80:80",
            "exa mple.com",
            "[::1",
            "[::1]x",
            "[]:80",
            "[zz]:80",
            "example.com/x",
        ] {
            assert!(host_of(bad).is_err(), "{bad:?} was taken as a host");
        }
    }

    /// Percent-encodes each byte of `s` or leaves it, as `mask` says: another spelling.
    fn respell(s: &str, mask: &[bool]) -> String {
        let mut out = String::new();
        for (i, b) in s.bytes().enumerate() {
            if b != b'/' && mask.get(i % mask.len().max(1)).copied().unwrap_or(false) {
                out.push_str(&format!("%{b:02X}"));
            } else {
                out.push(b as char);
            }
        }
        out
    }

    proptest! {
        #[test]
        fn no_two_spellings_reach_two_scopes(
            segs in proptest::collection::vec("[a-zA-Z0-9:._~-]{1,8}", 1..5),
            mask in proptest::collection::vec(any::<bool>(), 1..8),
        ) {
            let path = format!("/{}", segs.join("/"));
            let other = respell(&path, &mask);
            let a = scope_of("/{a}/{*rest}", "s/{a}/{rest}", &path);
            let b = scope_of("/{a}/{*rest}", "s/{a}/{rest}", &other);
            // Either both are refused or unmatched, or they agree.
            if a.is_some() && b.is_some() {
                prop_assert_eq!(a, b);
            }
            // Canonical forms agree whenever both are accepted.
            if let (Ok(x), Ok(y)) = (canonicalize(&path), canonicalize(&other)) {
                prop_assert_eq!(x, y);
            }
        }

        #[test]
        fn canonicalize_never_panics(raw in "\\PC{0,40}") {
            let _ = canonicalize(&raw);
        }

        #[test]
        fn accepted_segments_are_clean(raw in "/[a-zA-Z0-9%/.]{0,30}") {
            if let Ok(segs) = canonicalize(&raw) {
                for s in segs {
                    prop_assert!(!s.is_empty() && s != "." && s != "..");
                    prop_assert!(!s.contains(['/', '\\', '\0']));
                }
            }
        }
    }
}

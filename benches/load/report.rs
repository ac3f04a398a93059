//! The results: a markdown table (stdout and RESULTS.md) and a hand-written SVG with
//! throughput and p99 bars per workload and baseline.

use std::fmt::Write as _;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Baseline,
    Fencegate,
    Postgres,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// No target: a baseline or a number for context.
    Info,
    /// Could not be judged (a baseline it depends on did not run).
    NotJudged,
}

impl Verdict {
    fn text(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "**FAIL**",
            Verdict::Info => "info",
            Verdict::NotJudged => "n/a",
        }
    }

    pub fn from(ok: bool) -> Verdict {
        if ok { Verdict::Pass } else { Verdict::Fail }
    }
}

/// CPU used during one measurement (warm-up included), per process role:
/// (µs of CPU per request, cores busy on average).
#[derive(Clone, Debug, Default)]
pub struct CpuUse {
    pub proxy: Option<(f64, f64)>,
    pub backend: Option<(f64, f64)>,
    pub generator: Option<(f64, f64)>,
    /// Context switches of the proxy's threads (or processes) per request.
    pub proxy_switches: Option<f64>,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub group: &'static str,
    pub name: String,
    pub kind: Kind,
    pub rps: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub errors: Option<u64>,
    /// What the answers were (status counts), for the details section.
    pub statuses: String,
    pub target: String,
    pub ratio: String,
    pub verdict: Verdict,
    pub cpu: Option<CpuUse>,
}

impl Row {
    pub fn new(group: &'static str, name: impl Into<String>, kind: Kind) -> Row {
        Row {
            group,
            name: name.into(),
            kind,
            rps: None,
            p50_ms: None,
            p99_ms: None,
            errors: None,
            statuses: String::new(),
            target: "—".into(),
            ratio: "—".into(),
            verdict: Verdict::Info,
            cpu: None,
        }
    }
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

fn thousands(v: Option<f64>) -> String {
    let Some(v) = v else { return "—".into() };
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The results table in markdown.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| workload | target | req/s | p50 ms | p99 ms | errors | ratio vs baseline | verdict |\n\
         | --- | --- | ---: | ---: | ---: | ---: | --- | --- |\n",
    );
    let mut group = "";
    for r in rows {
        if r.group != group {
            group = r.group;
            let _ = writeln!(out, "| ***{group}*** | | | | | | | |");
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.name,
            r.target,
            thousands(r.rps),
            num(r.p50_ms, 2),
            num(r.p99_ms, 2),
            r.errors.map_or("—".into(), |e| e.to_string()),
            r.ratio,
            r.verdict.text(),
        );
    }
    out
}

/// Where the CPU went: per request and on average, for each measured row.
pub fn cpu_table(rows: &[Row]) -> String {
    let cell = |v: Option<(f64, f64)>| {
        v.map_or("—".into(), |(us, cores)| {
            format!("{us:.1} µs ({cores:.2} cores)")
        })
    };
    let mut out = String::from(
        "| workload | proxy CPU per request | proxy context switches per request | backend CPU per request | load generator CPU per request |\n\
         | --- | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        let Some(c) = &r.cpu else { continue };
        let _ = writeln!(
            out,
            "| {} / {} | {} | {} | {} | {} |",
            r.group,
            r.name,
            cell(c.proxy),
            c.proxy_switches.map_or("—".into(), |s| format!("{s:.2}")),
            cell(c.backend),
            cell(c.generator)
        );
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis maximum (1, 2, 2.5 or 5 × 10^k) at or above `v`: fifths of it are round.
fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

fn short(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 10.0 || (v >= 1.0 && v.fract() == 0.0) {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Grouped horizontal bars: one line per workload or baseline, throughput on the left
/// panel and p99 on the right, grouped by backend. `subtitle`: up to two lines.
pub fn svg(rows: &[Row], title: &str, subtitle: &str) -> String {
    let rows: Vec<&Row> = rows.iter().filter(|r| r.rps.is_some()).collect();
    let (label_w, panel_w, gap, margin) = (330.0, 330.0, 60.0, 12.0);
    let (row_h, bar_h, top) = (22.0, 14.0, 108.0);
    let x1 = margin + label_w + 10.0;
    let x2 = x1 + panel_w + gap;
    let width = x2 + panel_w + 70.0;
    let groups = {
        let mut g: Vec<&str> = rows.iter().map(|r| r.group).collect();
        g.dedup();
        g.len()
    };
    let plot_h = (rows.len() + groups) as f64 * row_h;
    let height = top + plot_h + 80.0;
    let max_rps = nice_max(rows.iter().filter_map(|r| r.rps).fold(0.0, f64::max));
    let max_p99 = nice_max(rows.iter().filter_map(|r| r.p99_ms).fold(0.0, f64::max));
    let color = |k: Kind| match k {
        Kind::Baseline => "#9e9e9e",
        Kind::Fencegate => "#1f77b4",
        Kind::Postgres => "#ff7f0e",
    };

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="Helvetica, Arial, sans-serif" font-size="12">"##
    );
    let _ = writeln!(
        s,
        r##"<rect width="100%" height="100%" fill="white"/>
<text x="{margin}" y="24" font-size="16" font-weight="bold">{}</text>"##,
        esc(title)
    );
    // One line of text per subtitle line (SVG text does not wrap).
    for (i, line) in subtitle.lines().take(2).enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{margin}" y="{}" fill="#555">{}</text>"##,
            44 + 16 * i,
            esc(line)
        );
    }
    // Throughput: linear from 0. p99: logarithmic, whole decades, because latencies
    // through the WebDAV store are two orders of magnitude above the null backend's.
    let lo = 10f64.powf(
        rows.iter()
            .filter_map(|r| r.p99_ms)
            .filter(|v| *v > 0.0)
            .fold(f64::INFINITY, f64::min)
            .log10()
            .floor(),
    );
    let lo = if lo.is_finite() { lo } else { 0.1 };
    let hi = 10f64.powf(max_p99.log10().ceil()).max(lo * 10.0);
    let decades = (hi / lo).log10().round() as i32;
    let rps_w = |v: f64| (panel_w * v / max_rps).max(1.0);
    let p99_w = |v: f64| (panel_w * (v.max(lo) / lo).log10() / f64::from(decades)).max(1.0);
    let mut ticks: Vec<(f64, String)> = (0..=5)
        .map(|i| {
            let v = max_rps * f64::from(i) / 5.0;
            (x1 + panel_w * f64::from(i) / 5.0, short(v))
        })
        .collect();
    ticks.extend((0..=decades).map(|d| {
        let v = lo * 10f64.powi(d);
        (x2 + panel_w * f64::from(d) / f64::from(decades), short(v))
    }));
    for (x, name) in [
        (x1, "throughput (req/s, higher is better)"),
        (x2, "p99 latency (ms, log scale, lower is better)"),
    ] {
        let _ = writeln!(
            s,
            r##"<text x="{x}" y="{}" font-weight="bold">{}</text>"##,
            top - 16.0,
            esc(name)
        );
    }
    for (gx, label) in &ticks {
        let _ = writeln!(
            s,
            r##"<line x1="{gx:.1}" y1="{}" x2="{gx:.1}" y2="{}" stroke="#ddd"/>
<text x="{gx:.1}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
            top - 6.0,
            top + plot_h,
            top + plot_h + 14.0,
            label
        );
    }
    let mut y = top;
    let mut group = "";
    for r in rows {
        if r.group != group {
            group = r.group;
            let _ = writeln!(
                s,
                r##"<text x="{margin}" y="{:.1}" font-weight="bold" fill="#333">{}</text>"##,
                y + 15.0,
                esc(group)
            );
            y += row_h;
        }
        let by = y + (row_h - bar_h) / 2.0;
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            margin + label_w,
            y + 15.0,
            esc(&r.name)
        );
        let stroke = if r.verdict == Verdict::Fail {
            r##" stroke="#d62728" stroke-width="2""##
        } else {
            ""
        };
        let bars = [
            (x1, r.rps.map(rps_w), r.rps.map(short)),
            (x2, r.p99_ms.map(p99_w), r.p99_ms.map(|p| format!("{p:.2}"))),
        ];
        for (x, w, text) in bars {
            let Some(w) = w else { continue };
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{by:.1}" width="{w:.1}" height="{bar_h}" fill="{}"{stroke}><title>{}: {}</title></rect>
<text x="{:.1}" y="{:.1}" fill="#222">{}</text>"##,
                color(r.kind),
                esc(&r.name),
                text.clone().unwrap_or_default(),
                x + w + 4.0,
                y + 15.0,
                text.unwrap_or_default()
            );
        }
        y += row_h;
    }
    let ly = top + plot_h + 44.0;
    let mut lx = margin;
    for (k, name) in [
        (
            Kind::Baseline,
            "baseline (direct / nginx proxy_pass / bare hyper)",
        ),
        (Kind::Fencegate, "fencegate"),
        (Kind::Postgres, "PostgreSQL conditional UPDATE (pgbench)"),
    ] {
        let _ = writeln!(
            s,
            r##"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"##,
            ly - 10.0,
            color(k),
            lx + 16.0,
            ly,
            esc(name)
        );
        lx += 24.0 + 7.0 * name.len() as f64;
    }
    let _ = writeln!(
        s,
        r##"<rect x="{lx}" y="{}" width="12" height="12" fill="white" stroke="#d62728" stroke-width="2"/><text x="{}" y="{}">misses its target</text>"##,
        ly - 10.0,
        lx + 16.0,
        ly
    );
    s.push_str("</svg>\n");
    s
}

//! A strict reader of Prometheus's text exposition format (version 0.0.4), for checking the
//! exporter's page: it refuses everything Prometheus's parsers refuse (a sample line that is
//! not one, an unknown escape in a label value, a second `# TYPE` for a family, a `# TYPE`
//! after the family's samples), and what they would take but a page of ours must never hold:
//! a control character other than the line ends, a sample outside the family declared just
//! before it, the same series twice.

use std::collections::BTreeSet;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name.
    pub name: String,
    /// Label names and their unescaped values, in the order written.
    pub labels: Labels,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A `# HELP` docstring: its only escapes are `\\` and `\n`.
fn check_help_text(text: &str) -> Result<(), String> {
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\\' && !matches!(chars.next(), Some('\\' | 'n')) {
            return Err("an escape other than \\\\ or \\n in HELP".into());
        }
    }
    Ok(())
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "NaN" => Ok(f64::NAN),
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        _ if s
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-')) =>
        {
            s.parse().map_err(|e| format!("value {s:?}: {e}"))
        }
        _ => Err(format!("value {s:?} is not a number")),
    }
}

/// Label names and their unescaped values, in the order written.
type Labels = Vec<(String, String)>;

/// `{name="value",...}` from the start of `rest`; returns the labels and what follows `}`.
fn parse_labels(mut rest: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (name, after) = rest
            .split_once('=')
            .ok_or("a label without `=`".to_owned())?;
        if !is_label_name(name) {
            return Err(format!("label name {name:?}"));
        }
        if labels.iter().any(|(k, _)| k == name) {
            return Err(format!("label {name} twice"));
        }
        let mut chars = after
            .strip_prefix('"')
            .ok_or(format!("label {name}: value not quoted"))?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label {name}: unterminated value")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("label {name}: escape {other:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((name.to_owned(), value));
        rest = &after[1 + end + 1..];
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err("labels not separated by `,`".into());
        }
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if !is_metric_name(name) {
        return Err(format!("metric name {name:?}"));
    }
    let (labels, rest) = match line[name_end..].strip_prefix('{') {
        Some(after) => parse_labels(after)?,
        None => (Vec::new(), &line[name_end..]),
    };
    let rest = rest.strip_prefix(' ').ok_or("no space before the value")?;
    let mut fields = rest.split(' ');
    let value = parse_value(fields.next().unwrap_or(""))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("more than a value and a timestamp".into());
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Every sample of `page`, or what is wrong with it (with the line).
pub fn parse(page: &str) -> Result<Vec<Sample>, String> {
    if let Some(c) = page.chars().find(|&c| c.is_control() && c != '\n') {
        return Err(format!("control character {c:?} in the page"));
    }
    if !page.is_empty() && !page.ends_with('\n') {
        return Err("the last line has no line end".into());
    }
    let mut samples = Vec::new();
    let mut typed = BTreeSet::new();
    let mut helped = BTreeSet::new();
    let mut seen_samples_of = BTreeSet::new();
    let mut series = BTreeSet::new();
    let mut family: Option<String> = None;
    for (n, line) in page.lines().enumerate() {
        let fail = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            if !is_metric_name(name) || !helped.insert(name.to_owned()) {
                return Err(fail("a bad or second HELP".into()));
            }
            check_help_text(text).map_err(fail)?;
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| fail("no type".into()))?;
            let known = ["counter", "gauge", "histogram", "summary", "untyped"];
            if !is_metric_name(name) || !known.contains(&kind) {
                return Err(fail("a bad TYPE".into()));
            }
            if !typed.insert(name.to_owned()) || seen_samples_of.contains(name) {
                return Err(fail("a second TYPE, or one after its samples".into()));
            }
            family = Some(name.to_owned());
        } else if line.starts_with('#') {
            // A comment: free text to the end of the line.
        } else {
            let s = parse_sample(line).map_err(fail)?;
            if family.as_deref() != Some(s.name.as_str()) {
                return Err(fail(format!("a sample outside its family {family:?}")));
            }
            let mut key: Vec<_> = s.labels.clone();
            key.sort();
            if !series.insert((s.name.clone(), key)) {
                return Err(fail("the same series twice".into()));
            }
            seen_samples_of.insert(s.name.clone());
            samples.push(s);
        }
    }
    Ok(samples)
}

#[test]
fn the_strict_reader_refuses_what_prometheus_refuses() {
    let ok = "# HELP a_b A \\\\ help\\n.\n# TYPE a_b gauge\na_b{x=\"q\\\"\\\\\\n\",y=\"\"} 1\na_b 2.5e3\n";
    let s = parse(ok).unwrap();
    assert_eq!(s[0].label("x"), Some("q\"\\\n"));
    assert_eq!(s[1].value, 2500.0);
    for bad in [
        "# TYPE a gauge\na{x=\"\\t\"} 1\n",
        "# TYPE a gauge\na{x=\"1\"}\n",
        "# TYPE a gauge\na 1\nb 1\n",
        "# TYPE a gauge\na 1\na 2\n",
        "# TYPE a gauge\n# TYPE a gauge\n",
        "# TYPE a gauge\na{x=\"\u{1b}\"} 1\n",
        "# TYPE a gauge\nnot a metric line\n",
        "# HELP a bad \\q\n",
        "# TYPE a gauge\na 1",
    ] {
        assert!(parse(bad).is_err(), "{bad:?}");
    }
}

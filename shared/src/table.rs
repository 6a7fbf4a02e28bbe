//! Plain aligned tables for the human output of `next`, `status` and `dlq list`.

/// Left-aligned columns, two spaces apart, widths from the widest cell (in characters),
/// trailing spaces trimmed; one line per row after the header line.
pub fn render<S: AsRef<str>>(headers: &[&str], rows: &[Vec<S>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.as_ref().chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> = cells
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(AsRef::as_ref));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns_and_trims_line_ends() {
        let rows = vec![vec!["a", "bbbb", ""], vec!["ccc", "d", "é"]];
        assert_eq!(
            render(&["X", "Y", "Z"], &rows),
            "X    Y     Z\na    bbbb\nccc  d     é\n"
        );
    }
}

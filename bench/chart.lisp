;;;; chart.lisp -- a small-multiples bar chart as a self-contained SVG file,
;;;; written with nothing but FORMAT (no dependency).
;;;;
;;;; A chart is a title, a legend and rows of panels; a panel is one scenario,
;;;; with one horizontal bar per server, scaled to the largest bar of that
;;;; panel's compared bars (the servers differ by orders of magnitude across
;;;; scenarios, so a common scale would flatten most panels, and so would
;;;; nginx's bar: it is drawn cut when it is off that scale).  Every bar
;;;; carries its number.

(in-package #:gallop-bench)

(defparameter *server-colors*
  '((:stock . "#8c8c8c") (:gallop . "#1f77b4") (:gallop-tm . "#2ca02c") (:native . "#d62728") (:nginx . "#e8a33d"))
  "Bar colour of each server kind.")

(defun server-color (kind)
  (or (cdr (assoc kind *server-colors*)) "#444444"))

(defun xml-escape (string)
  (with-output-to-string (out)
    (loop for c across string
          do (case c
               (#\& (write-string "&amp;" out))
               (#\< (write-string "&lt;" out))
               (#\> (write-string "&gt;" out))
               (#\" (write-string "&quot;" out))
               (t (write-char c out))))))

;;; Geometry, in pixels.
(defconstant +panel-width+ 340)
(defconstant +panel-gap+ 18)
(defconstant +label-width+ 118)
(defconstant +bar-max+ 100)
(defconstant +bar-height+ 15)
(defconstant +bar-step+ 21)
(defconstant +panel-head+ 26)
(defconstant +margin+ 16)

(defun panel-height (panel)
  (+ +panel-head+ (* +bar-step+ (max 1 (length (getf panel :bars)))) 8))

(defun write-panel (out panel x y)
  "PANEL: (:title STRING :bars ((LABEL VALUE TEXT COLOR [REFERENCE]) ...)).
VALUE NIL draws no bar (TEXT says why).  The scale is set by the bars that
are not REFERENCE bars, so that nginx, several times faster, does not flatten
the servers being compared: a reference bar beyond the scale is cut, with a
break mark, and its number still says how long it is."
  (let* ((bars (getf panel :bars))
         (compared (remove nil (mapcar #'second (remove-if #'fifth bars))))
         (top (reduce #'max (or compared (remove nil (mapcar #'second bars))) :initial-value 0))
         (height (panel-height panel)))
    (format out "<g transform=\"translate(~D,~D)\">~%" x y)
    (format out "<rect x=\"0\" y=\"0\" width=\"~D\" height=\"~D\" fill=\"#fafafa\" stroke=\"#dddddd\"/>~%"
            +panel-width+ height)
    (format out "<text x=\"8\" y=\"17\" font-size=\"12\" font-weight=\"bold\">~A</text>~%"
            (xml-escape (getf panel :title)))
    (loop for (label value text color) in bars
          for i from 0
          for by = (+ +panel-head+ (* i +bar-step+))
          for cut = (and value (plusp top) (> value (* 1.15 top)))
          for width = (cond ((or (null value) (not (plusp top))) 0)
                            (cut (round (* 1.15 +bar-max+)))
                            (t (max 1 (round (* +bar-max+ (/ value top))))))
          do (format out "<text x=\"~D\" y=\"~D\" font-size=\"11\" text-anchor=\"end\">~A</text>~%"
                     (- +label-width+ 6) (+ by 12) (xml-escape label))
             (when (plusp width)
               (format out "<rect x=\"~D\" y=\"~D\" width=\"~D\" height=\"~D\" fill=\"~A\"/>~%"
                       +label-width+ by width +bar-height+ color))
             (when cut
               ;; A break mark: two white slashes across the bar's end.
               (loop for dx in '(-14 -9)
                     do (format out "<line x1=\"~D\" y1=\"~D\" x2=\"~D\" y2=\"~D\" stroke=\"white\" stroke-width=\"2\"/>~%"
                                (+ +label-width+ width dx -3) (+ by +bar-height+ 1)
                                (+ +label-width+ width dx 3) (- by 1))))
             (format out "<text x=\"~D\" y=\"~D\" font-size=\"11\"~:[ fill=\"#b00020\"~;~]>~A</text>~%"
                     (+ +label-width+ width 5) (+ by 12) value (xml-escape text)))
    (format out "<line x1=\"~D\" y1=\"~D\" x2=\"~D\" y2=\"~D\" stroke=\"#999999\"/>~%"
            +label-width+ (- +panel-head+ 3) +label-width+ (- height 6))
    (format out "</g>~%")
    height))

(defun write-svg-chart (path &key title subtitle legend rows)
  "Write the chart to PATH.  LEGEND: ((LABEL COLOR) ...).  ROWS: a list of
rows, each a list of panels (see WRITE-PANEL), optionally preceded by a
string: that row's heading."
  (let* ((columns (reduce #'max (mapcar (lambda (row) (count-if-not #'stringp row)) rows)
                          :initial-value 1))
         (width (+ (* 2 +margin+) (* columns +panel-width+) (* (1- columns) +panel-gap+)))
         (header 74)
         (row-heights (mapcar (lambda (row)
                                (+ (if (stringp (first row)) 22 0)
                                   (reduce #'max (mapcar #'panel-height (remove-if #'stringp row))
                                           :initial-value 0)))
                              rows))
         (height (+ header (reduce #'+ row-heights) (* +panel-gap+ (length rows)) +margin+)))
    (ensure-directories-exist path)
    (with-open-file (out path :direction :output :if-exists :supersede :external-format :utf-8)
      (format out "<?xml version=\"1.0\" encoding=\"UTF-8\"?>~%")
      (format out "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"~D\" height=\"~D\" ~
                   viewBox=\"0 0 ~D ~D\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">~%"
              width height width height)
      (format out "<rect x=\"0\" y=\"0\" width=\"~D\" height=\"~D\" fill=\"white\"/>~%" width height)
      (format out "<text x=\"~D\" y=\"26\" font-size=\"17\" font-weight=\"bold\">~A</text>~%"
              +margin+ (xml-escape title))
      (when subtitle
        (format out "<text x=\"~D\" y=\"45\" font-size=\"11\" fill=\"#555555\">~A</text>~%"
                +margin+ (xml-escape subtitle)))
      (loop with lx = +margin+
            for (label color) in legend
            do (format out "<rect x=\"~D\" y=\"54\" width=\"12\" height=\"12\" fill=\"~A\"/>~%" lx color)
               (format out "<text x=\"~D\" y=\"64\" font-size=\"11\">~A</text>~%"
                       (+ lx 16) (xml-escape label))
               (incf lx (+ 30 (* 6 (length label)))))
      (loop with y = header
            for row in rows
            for row-height in row-heights
            do (let ((panels row) (py y))
                 (when (stringp (first row))
                   (format out "<text x=\"~D\" y=\"~D\" font-size=\"13\" font-weight=\"bold\" fill=\"#333333\">~A</text>~%"
                           +margin+ (+ y 15) (xml-escape (first row)))
                   (setf panels (rest row))
                   (incf py 22))
                 (loop for panel in panels
                       for x from +margin+ by (+ +panel-width+ +panel-gap+)
                       do (write-panel out panel x py)))
               (incf y (+ row-height +panel-gap+)))
      (format out "</svg>~%"))
    path))

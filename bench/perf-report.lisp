;;;; perf-report.lisp -- `perf` samples of a Lisp server, named and counted.
;;;;
;;;;   perf script -i perf.data -F ip,sym > samples.txt
;;;;   scripts/lisp.sh --load bench/perf-report.lisp \
;;;;     --end-toplevel-options samples.txt /tmp/perf-PID.map [TOP [FUNCTION...]]
;;;;
;;;; `perf report` names Lisp functions compiled after startup through
;;;; /tmp/perf-PID.map (bench/perf-map.lisp, the "perf-map" command of
;;;; bench/server.lisp), but not SBCL's own, which run from the core file
;;;; (sbcl.core: GETF, PUTHASH, MAKE-HASH-TABLE...).  The map lists those too;
;;;; this applies it to every sample itself.  For each sample, the leaf frame
;;;; is named: a kernel symbol as perf printed it (prefixed "k "), a Lisp
;;;; function from the map ("L "), else what perf printed ("? ").  Prints the
;;;; number of samples, the share outside the kernel, and the TOP (default 40)
;;;; names by share of samples (self).  With call chains (`perf record -g`,
;;;; samples separated by empty lines) it also prints the TOP Lisp functions
;;;; by inclusive share (samples whose chain holds the function; a chain
;;;; stops at C code without frame pointers, e.g. in libc, so the kernel time
;;;; under a system call is not counted in the Lisp function that made it),
;;;; and for each FUNCTION (a substring of a name) the most common three
;;;; callers of the samples it is the leaf of.
;;;;
;;;; In call chains perf prints frames in sbcl.core as offsets in that file,
;;;; not addresses; they are named at offset + PERF_CORE_OFFSET (hexadecimal,
;;;; environment; default 50ED0000: where SBCL 2.2.9 of Debian maps its
;;;; core's code, found by hand: names that make sense as callers).  A
;;;; measuring tool: doc/design.md, "Lisp frames in perf".

(defpackage #:gallop-bench-perf (:use #:common-lisp))
(in-package #:gallop-bench-perf)

(defun read-map (path)
  "The map's entries as a vector of (START END . NAME), sorted by START."
  (let ((entries '()))
    (with-open-file (in path)
      (loop for line = (read-line in nil)
            while line
            do (let* ((s1 (position #\Space line))
                      (s2 (and s1 (position #\Space line :start (1+ s1)))))
                 (when s2
                   (let ((start (parse-integer line :end s1 :radix 16))
                         (size (parse-integer line :start (1+ s1) :end s2 :radix 16)))
                     (push (list* start (+ start size) (subseq line (1+ s2))) entries))))))
    (sort (coerce entries 'simple-vector) #'< :key #'first)))

(defun map-name (map address)
  "The name of the map entry holding ADDRESS, or NIL."
  (let ((lo 0) (hi (length map)))
    ;; The last entry starting at or below ADDRESS.
    (loop while (< lo hi)
          do (let ((mid (floor (+ lo hi) 2)))
               (if (<= (first (svref map mid)) address)
                   (setf lo (1+ mid))
                   (setf hi mid))))
    (when (plusp lo)
      (let ((entry (svref map (1- lo))))
        (when (< address (second entry))
          (cddr entry))))))

(defun frame-name (map core-offset line)
  "The name of the frame printed as LINE (\"IP SYM...\")."
  (let* ((text (string-trim '(#\Space #\Tab) line))
         (space (position #\Space text))
         (ip (ignore-errors (parse-integer text :end space :radix 16)))
         (sym (if space (string-trim " " (subseq text space)) "")))
    (when ip
      (let ((lisp (and (< ip #xffff000000000000)
                       (or (map-name map ip)
                           (and (< ip #x100000000) (map-name map (+ ip core-offset)))))))
        (cond ((>= ip #xffff000000000000) (concatenate 'string "k " sym))
              (lisp (concatenate 'string "L " lisp))
              (t (concatenate 'string "? " sym)))))))

(defun read-samples (path map core-offset)
  "The samples in PATH (`perf script -F ip,sym`), each a list of frame names,
leaf first; and whether they have call chains (then samples are separated by
empty lines; without, each line is one)."
  (let ((samples '()) (current '()) (chains nil))
    (with-open-file (in path)
      (loop for line = (read-line in nil)
            while line
            do (if (string= (string-trim '(#\Space #\Tab) line) "")
                   (progn (setf chains t)
                          (when current (push (nreverse current) samples) (setf current '())))
                   (let ((name (frame-name map core-offset line)))
                     (when name (push name current))))))
    (if chains
        (values (nreverse (if current (cons (nreverse current) samples) samples)) t)
        ;; No empty line: CURRENT holds every sample's one frame.
        (values (mapcar #'list (nreverse current)) nil))))

(defun top (table n total)
  (let ((rows '()))
    (maphash (lambda (k v) (push (cons k v) rows)) table)
    (loop for (name . count) in (sort rows #'> :key #'cdr)
          repeat n
          do (format t "~7,2F%  ~A~%" (/ (* 100.0 count) total) name))))

(defun report (samples-path map-path &key (top 40) functions)
  (let* ((core-offset (parse-integer (or (sb-ext:posix-getenv "PERF_CORE_OFFSET") "50ED0000")
                                     :radix 16))
         (map (read-map map-path)))
    (multiple-value-bind (samples chains) (read-samples samples-path map core-offset)
      (let ((total (length samples))
            (self (make-hash-table :test 'equal))
            (inclusive (make-hash-table :test 'equal)))
        (dolist (s samples)
          (incf (gethash (first s) self 0))
          (when chains
            (dolist (name (remove-duplicates s :test #'string=))
              (when (eql 0 (search "L " name))
                (incf (gethash name inclusive 0))))))
        (format t "~D samples~:[~; with call chains~]; outside the kernel: ~,1F%~%"
                total chains
                (/ (* 100.0 (count-if-not (lambda (s) (eql 0 (search "k " (first s)))) samples))
                   (max 1 total)))
        (format t "~%Self:~%")
        (top self top total)
        (when chains
          (format t "~%Inclusive, Lisp functions:~%")
          (top inclusive top total)
          (dolist (f functions)
            (let ((callers (make-hash-table :test 'equal)) (n 0))
              (dolist (s samples)
                (when (search f (first s))
                  (incf n)
                  (incf (gethash (format nil "~{~A~^ <- ~}" (subseq (rest s) 0 (min 3 (length (rest s)))))
                                 callers 0))))
              (format t "~%Callers of ~A (~D samples):~%" f n)
              (top callers 8 (max 1 n)))))))))

(let ((args (rest sb-ext:*posix-argv*)))
  (if (< (length args) 2)
      (progn (format *error-output* "usage: perf-report.lisp --end-toplevel-options SAMPLES MAP [TOP [FUNCTION...]]~%")
             (sb-ext:exit :code 2))
      (report (first args) (second args)
              :top (if (third args) (parse-integer (third args)) 40)
              :functions (nthcdr 3 args))))

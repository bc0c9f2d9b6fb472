;;;; decimal.lisp -- GALLOP.CORE:PUT-DECIMAL (the digits of a Content-Length
;;;; or chunk size into an output buffer) against FORMAT ~D, on byte
;;;; vectors: no sockets, milliseconds.  Each value is written at an offset
;;;; into a buffer filled with a sentinel; the octets around the digits must
;;;; stay as they were.

(in-package #:gallop-tests)

(in-suite core)

(defconstant +decimal-sentinel+ #xA5)

(defun put-decimal-problem (n fill &key (room 0))
  "Write N with PUT-DECIMAL at FILL into a buffer of sentinels with ROOM octets
to spare after the digits: NIL if it wrote exactly (FORMAT NIL \"~D\" N) there,
touched nothing else and returned the index after the digits; else a
description of what went wrong."
  (let* ((expected (format nil "~D" n))
         (size (+ fill (length expected) room))
         (buffer (make-array size :element-type '(unsigned-byte 8)
                                  :initial-element +decimal-sentinel+))
         (result (gallop.core:put-decimal buffer fill n))
         (digits (map 'string #'code-char
                      (subseq buffer fill (min size (+ fill (length expected)))))))
    (cond ((not (eql result (+ fill (length expected))))
           (list n :fill fill :returned result :expected (+ fill (length expected))))
          ((string/= digits expected)
           (list n :fill fill :wrote digits))
          ((find +decimal-sentinel+ buffer :end fill :test #'/=)
           (list n :fill fill :touched-before buffer))
          ((find +decimal-sentinel+ buffer :start result :test #'/=)
           (list n :fill fill :touched-after buffer)))))

(defun put-decimal-problems (values)
  "PUT-DECIMAL-PROBLEM for each of VALUES at several offsets and room: the
problems found."
  (loop for n in values
        for i from 0
        nconc (loop for (fill room) in (list (list 0 0) (list 1 0) (list (1+ (mod i 13)) 3)
                                             (list 0 5) (list 100 0))
                    for problem = (put-decimal-problem n fill :room room)
                    when problem collect problem)))

(defun report-problems (what problems)
  (is (null problems) "~A: ~D wrong, e.g. ~S" what (length problems)
      (subseq problems 0 (min 5 (length problems)))))

(test put-decimal-0-to-10000
  (report-problems "0..10000" (put-decimal-problems (loop for n from 0 to 10000 collect n))))

(test put-decimal-powers-of-ten-and-their-neighbours
  (let ((values (remove-duplicates
                 (remove-if-not (lambda (n) (typep n '(and fixnum unsigned-byte)))
                                (append
                                 (loop for k from 0 to 19
                                       for p = (expt 10 k)
                                       append (list (1- p) p (1+ p) (* 9 p) (1- (* 2 p))))
                                 (loop for k from 0 to 62
                                       for p = (expt 2 k)
                                       append (list (1- p) p (1+ p)))
                                 (list most-positive-fixnum (1- most-positive-fixnum)
                                       (floor most-positive-fixnum 10)
                                       (* 10 (floor most-positive-fixnum 10))))))))
    ;; every power of ten a fixnum holds, and the largest fixnum, are there
    (is (= 19 (count-if (lambda (n) (member n values)) (loop for k from 0 to 18 collect (expt 10 k)))))
    (is (member most-positive-fixnum values))
    (report-problems "powers and neighbours" (put-decimal-problems values))
    ;; each value's digits, as many as FORMAT writes: a fixnum has at most 19
    ;; (CONNECTION-WRITE-DECIMAL reserves 20)
    (is (= 19 (gallop.core:put-decimal (make-array 19 :element-type '(unsigned-byte 8)) 0
                                       most-positive-fixnum)))))

(test put-decimal-random-fixnums
  ;; Log-uniform over the fixnums: as many 15-digit values as 3-digit ones.
  (let ((random (sb-ext:seed-random-state 4321)))
    (report-problems "random fixnums"
                     (put-decimal-problems
                      (loop repeat 5000
                            collect (random (1+ (ash most-positive-fixnum
                                                     (- (random 62 random))))
                                            random))))))

(test put-decimal-in-place-in-a-line
  ;; As a chunk-size line: two values one after the other into one buffer.
  (let* ((buffer (make-array 32 :element-type '(unsigned-byte 8) :initial-element 0))
         (fill (gallop.core:put-decimal buffer 3 1234567)))
    (setf (aref buffer fill) 32)
    (let ((end (gallop.core:put-decimal buffer (1+ fill) 0)))
      (is (= 10 fill))
      (is (= 12 end))
      (is (string= (format nil "~C~C~C1234567 0" (code-char 0) (code-char 0) (code-char 0))
                   (map 'string #'code-char (subseq buffer 0 end))))
      (is (every #'zerop (subseq buffer end))))))

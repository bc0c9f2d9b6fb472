;;;; chunk-decoder.lisp -- GALLOP.CORE's chunk decoder on byte vectors: no
;;;; sockets, milliseconds.  Each body is decoded whole and split at every
;;;; octet; both must give the same data (or the same refusal), and the
;;;; decoder must stop exactly at the end of the body.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the chunk decoder itself
;;;; (http/chunks.lisp: MAKE-CHUNK-DECODER, CHUNK-DECODER-STEP, -TAKE,
;;;; -STATE, -LEFT, RESET-CHUNK-DECODER), the thing tested, on byte vectors.

(in-package #:gallop-tests)

(in-suite core)

(defun decode-chunked (octets &key (max 1000000) (pieces 1))
  "Decode OCTETS as a chunked body, fed in PIECES parts (1: whole; :EVERY:
one octet at a time).  Returns the data octets and the number of octets the
body took, or :ERROR and the REQUEST-BODY-ERROR's status."
  (let ((d (gallop.core::reset-chunk-decoder (gallop.core::make-chunk-decoder) max))
        (data (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (n (length octets)))
    (handler-case
        (flet ((feed (start end)
                 ;; Everything of OCTETS[START,END) that belongs to the body.
                 (loop while (and (< start end) (gallop.core::chunk-decoder-state d))
                       do (if (eq (gallop.core::chunk-decoder-state d) :data)
                              (let ((k (min (gallop.core::chunk-decoder-left d) (- end start))))
                                (loop for i from start below (+ start k)
                                      do (vector-push-extend (aref octets i) data))
                                (gallop.core::chunk-decoder-take d k)
                                (incf start k))
                              (setf start (gallop.core::chunk-decoder-step d octets start end))))
                 start))
          (let ((used (if (eq pieces :every)
                          (loop for i from 0 below n
                                for next = (feed i (1+ i))
                                when (null (gallop.core::chunk-decoder-state d)) return next
                                finally (return n))
                          (feed 0 n))))
            (if (gallop.core::chunk-decoder-state d)
                (values :incomplete used)
                (values (coerce data '(simple-array (unsigned-byte 8) (*))) used))))
      (gallop.core:request-body-error (e)
        (values :error (gallop.core:request-body-error-status e))))))

(defun wire (string)
  "STRING with | for CRLF, as octets."
  (let ((out '()))
    (loop for ch across string
          do (if (char= ch #\|)
                 (progn (push 13 out) (push 10 out))
                 (push (char-code ch) out)))
    (coerce (nreverse out) '(simple-array (unsigned-byte 8) (*)))))

(defparameter *decoder-cases*
  '(;; body                                     expected data or (:error status)
    ("5|hello|0||"                               "hello")
    ("5|hello|6| world|0||"                      "hello world")
    ("A|0123456789|0||"                          "0123456789")
    ("a|0123456789|0||"                          "0123456789")
    ("0000000000000005|hello|0||"                "hello")  ; leading zeros are digits
    ("5;a=b|hello|0||"                           "hello")
    ("5 ; a = b ; c|hello|0;x=\"y\"||"          "hello")
    ("5;a=\"q\\\"uo;ted\"|hello|0||"             "hello")
    ("5|hello|0|X-Trailer: yes|Y: 1||"           "hello")
    ("0||"                                       "")
    ("5 |hello|0||"                              (:error 400)) ; white space, no extension
    ("5\t|hello|0||"                             (:error 400))
    (" 5|hello|0||"                              (:error 400))
    ("|hello|0||"                                (:error 400)) ; empty size
    ("g|hello|0||"                               (:error 400))
    ("0x5|hello|0||"                             (:error 400))
    ("-5|hello|0||"                              (:error 400))
    ("5;|hello|0||"                              (:error 400)) ; empty extension name
    ("5;=b|hello|0||"                            (:error 400))
    ("5;a=|hello|0||"                            (:error 400)) ; empty value
    ("5;a=\"b|hello|0||"                         (:error 400)) ; unbalanced quote
    ("5;a b|hello|0||"                           (:error 400))
    ("5|hellox|0||"                              (:error 400)) ; data longer than its size
    ("5|hell|0||"                                (:error 400)) ; shorter: its CRLF is data
    ("5|hello|0|X-Trailer yes||"                 (:error 400)) ; trailer without colon
    ("5|hello|0| folded: x||"                    (:error 400))
    ("10000000000000005|hello|0||"               (:error 400)) ; past a fixnum
    ("fffff|x|0||"                               (:error 413))) ; past MAX
  "Chunked bodies with | for CRLF, and the data or the refusal expected.")

(test chunk-decoder-on-byte-vectors
  (loop for (text expected) in *decoder-cases*
        do (let ((octets (wire text)))
             (dolist (pieces '(1 :every))
               (multiple-value-bind (result extra) (decode-chunked octets :pieces pieces)
                 (if (stringp expected)
                     (progn
                       (is (equalp (octets expected) result)
                           "~S (~A): decoded ~S" text pieces result)
                       ;; it stops at the body's end, no further
                       (is (eql (length octets) extra) "~S (~A): took ~S of ~D octets"
                           text pieces extra (length octets)))
                     (is (and (eq :error result) (eql (second expected) extra))
                         "~S (~A): expected ~S, got ~S ~S" text pieces expected result extra)))))))

(test chunk-decoder-refuses-bare-line-ends-and-long-lines
  (flet ((bytes (&rest parts)
           (coerce (loop for p in parts
                         append (if (stringp p) (map 'list #'char-code p) (list p)))
                   '(simple-array (unsigned-byte 8) (*)))))
    (dolist (octets (list (bytes "5" 10 "hello" 13 10 "0" 13 10 13 10)      ; bare LF after the size
                          (bytes "5" 13 "hello" 13 10 "0" 13 10 13 10)      ; bare CR
                          (bytes "5" 13 10 "hello" 10 "0" 13 10 13 10)      ; bare LF after data
                          (bytes "5" 13 10 "hello" 13 10 "0" 13 10 10)))    ; bare LF at the end
      (is (eq :error (decode-chunked octets)) "accepted ~S" octets)))
  ;; a size line (with extensions) or trailer line over 1024 octets
  (is (eq :error (decode-chunked (wire (format nil "5;~A|hello|0||" (make-string 1100 :initial-element #\a))))))
  (is (eq :error (decode-chunked (wire (format nil "5|hello|0|X: ~A||" (make-string 1100 :initial-element #\a))))))
  (is (stringp (map 'string #'code-char
                    (decode-chunked (wire (format nil "5;~A|hello|0||" (make-string 900 :initial-element #\a))))))))

(test chunk-decoder-bounds-extensions-and-trailers-in-all
  ;; Each line is short, but together they pass 64 KiB: refused.
  (flet ((many (n line) (with-output-to-string (s) (dotimes (i n) (write-string line s)))))
    (is (eq :error (decode-chunked (wire (concatenate 'string (many 7000 "1;ext=123456789|x|") "0||")))))
    (is (eq :error (decode-chunked (wire (concatenate 'string "1|x|0|" (many 7000 "X-T: 123456789|") "|")))))
    ;; and a body with a few of them is fine
    (is (equalp (octets "xxx")
                (decode-chunked (wire (concatenate 'string (many 3 "1;ext=123456789|x|") "0|X-T: 1||")))))))

(test chunk-decoder-leaves-what-follows-the-body
  ;; A pipelined request after the body is not the decoder's.
  (let ((octets (wire "5|hello|0||GET / HTTP/1.1|Host: x||")))
    (multiple-value-bind (data used) (decode-chunked octets)
      (is (equalp (octets "hello") data))
      (is (= (length (wire "5|hello|0||")) used)))))
